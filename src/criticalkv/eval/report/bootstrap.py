"""Bootstrap confidence intervals for the report's cells and paired Critical-X minus X differences.

Percentile bootstrap (Efron & Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13): the
statistic is recomputed on ``resamples`` samples drawn with replacement, and the interval is the
``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of those. A cell that averages per-task means
(the report's ``average``) is resampled within each task (a stratified bootstrap), so every
resample keeps the tasks' weights. Every interval is seeded: a report is the same each time.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
SEED = 0
#: the fewest paired samples from which a paired interval is read as telling a difference from zero:
#: a percentile bootstrap of a handful of values only reshuffles those values (with 2 samples its
#: "interval" is the range of 2 numbers), so below this the report says "too few samples to tell"
MIN_PAIRED_SAMPLES = 10

#: the summary columns :func:`cell_intervals` fills, per measured column
INTERVAL_COLUMNS = {name: (f"{name}_ci_low", f"{name}_ci_high") for name in ("score", "nll_increase", "top1")}


def stratified_interval(
    strata: Sequence[Sequence[float]], *, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED
) -> tuple[float, float]:
    """Percentile interval of the mean of per-stratum means (one stratum: of the plain mean).

    Empty strata are left out; with no values at all the interval is ``(nan, nan)``.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"the confidence level must be in (0, 1), not {level}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be a positive integer, not {resamples!r}")
    groups = [np.asarray(s, dtype=np.float64) for s in strata if len(s)]
    if not groups:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    total = np.zeros(resamples)
    for values in groups:
        picks = rng.integers(0, len(values), size=(resamples, len(values)))
        total += values[picks].mean(axis=1)
    means = total / len(groups)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def cell_intervals(
    items: Sequence[Mapping[str, Any]], nll_deltas: Sequence[float], *, by_task: bool, **options: Any
) -> dict[str, float]:
    """The 95% intervals of one summary cell: its score (in percent), NLL increase and top-1.

    ``items`` are the cell's results; ``nll_deltas`` their NLL increases over the full cache;
    ``by_task``: the cell averages per-task means (the score is resampled within each task).
    """
    per_task: dict[str, list[float]] = defaultdict(list)
    for r in items:
        per_task[r["task"] if by_task else ""].append(100 * r["score"])
    out: dict[str, float] = {}
    for name, strata in (
        ("score", list(per_task.values())),
        ("nll_increase", [list(nll_deltas)]),
        ("top1", [[r["top1"] for r in items]]),
    ):
        low, high = stratified_interval(strata, **options)
        out[INTERVAL_COLUMNS[name][0]], out[INTERVAL_COLUMNS[name][1]] = low, high
    return out


def _sample_key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    return record["task"], record["length"], record["index"]


def paired_difference(
    mine: Mapping[tuple[Any, ...], Mapping[str, Any]],
    base: Mapping[tuple[Any, ...], Mapping[str, Any]],
    **options: Any,
) -> dict[str, float] | None:
    """``mine`` minus ``base`` on the samples both have (records keyed by (task, length, index)).

    The score difference is in percentage points, its mean over per-task means (as the report's
    ``average``), its interval stratified by task; the NLL difference is a plain mean. Returns
    ``{"n", "score_diff", "score_diff_low", "score_diff_high", "nll_diff", "nll_diff_low",
    "nll_diff_high", "gained", "lost"}`` (``gained``/``lost``: the shared samples ``mine`` scores
    higher/lower than ``base``), or ``None`` when no sample is shared.
    """
    shared = sorted(set(mine) & set(base), key=str)
    if not shared:
        return None
    score: dict[str, list[float]] = defaultdict(list)
    nll: list[float] = []
    for key in shared:
        score[key[0]].append(100 * (mine[key]["score"] - base[key]["score"]))
        nll.append(mine[key]["nll"] - base[key]["nll"])
    score_low, score_high = stratified_interval(list(score.values()), **options)
    nll_low, nll_high = stratified_interval([nll], **options)
    return {
        "n": float(len(shared)),
        "score_diff": float(np.mean([np.mean(v) for v in score.values()])),
        "score_diff_low": score_low,
        "score_diff_high": score_high,
        "nll_diff": float(np.mean(nll)),
        "nll_diff_low": nll_low,
        "nll_diff_high": nll_high,
        "gained": float(sum(mine[k]["score"] > base[k]["score"] for k in shared)),
        "lost": float(sum(mine[k]["score"] < base[k]["score"] for k in shared)),
    }


def by_config(
    records: Sequence[Mapping[str, Any]], length: str = "all"
) -> dict[tuple[str, Any], dict[tuple[Any, ...], Mapping[str, Any]]]:
    """Records grouped as ``{(method, budget): {(task, length, index): record}}`` (one length, or all)."""
    out: dict[tuple[str, Any], dict[tuple[Any, ...], Mapping[str, Any]]] = defaultdict(dict)
    for r in records:
        if length == "all" or str(r["length"]) == length:
            out[(r["method"], r["budget"])][_sample_key(r)] = r
    return out


def paired_differences(
    records: Sequence[Mapping[str, Any]], length: str = "all", **options: Any
) -> dict[tuple[str, Any], dict[str, float]]:
    """For each ``critical-X`` and budget: ``critical-X`` minus ``X`` on the samples both ran
    (:func:`paired_difference`), as ``{(method, budget): difference}``."""
    configs = by_config(records, length)
    out: dict[tuple[str, Any], dict[str, float]] = {}
    for (method, budget), mine in configs.items():
        if not method.startswith("critical-"):
            continue
        base = configs.get((method.removeprefix("critical-"), budget))
        diff = paired_difference(mine, base, **options) if base is not None else None
        if diff is not None:
            out[(method, budget)] = diff
    return out


def paired_against_full(
    records: Sequence[Mapping[str, Any]], length: str = "all", **options: Any
) -> dict[tuple[str, Any], dict[str, float]]:
    """For each compressed (method, budget): it minus the full cache on the samples both ran
    (:func:`paired_difference`), as ``{(method, budget): difference}``."""
    configs = by_config(records, length)
    full = next((mine for (method, _), mine in configs.items() if method == "full"), None)
    out: dict[tuple[str, Any], dict[str, float]] = {}
    for (method, budget), mine in configs.items():
        diff = paired_difference(mine, full, **options) if full is not None and method != "full" else None
        if diff is not None:
            out[(method, budget)] = diff
    return out


def distinguishable(low: float, high: float) -> bool:
    """Whether an interval excludes zero."""
    return not (math.isnan(low) or math.isnan(high)) and (low > 0 or high < 0)


def describe_difference(diff: Mapping[str, float], *, min_samples: int = MIN_PAIRED_SAMPLES) -> str:
    """One line: the paired differences with their intervals and whether each is told from zero.

    With fewer than ``min_samples`` paired samples (default :data:`MIN_PAIRED_SAMPLES`) the
    intervals are still printed but no verdict is drawn: "too few samples to tell (n=...)".
    """
    n = int(diff["n"])

    def verdict(low: float, high: float) -> str:
        if n < min_samples:
            return f"too few samples to tell (n={n} < {min_samples})"
        return "distinguishable from 0" if distinguishable(low, high) else "not distinguishable from 0"

    return (
        f"score {diff['score_diff']:+.1f} pts [{diff['score_diff_low']:+.1f}, {diff['score_diff_high']:+.1f}] "
        f"({verdict(diff['score_diff_low'], diff['score_diff_high'])}), "
        f"NLL {diff['nll_diff']:+.3f} [{diff['nll_diff_low']:+.3f}, {diff['nll_diff_high']:+.3f}] "
        f"({verdict(diff['nll_diff_low'], diff['nll_diff_high'])}), n={int(diff['n'])} paired samples"
        + (f" ({int(diff['gained'])} scored higher, {int(diff['lost'])} lower)" if "gained" in diff else "")
    )
