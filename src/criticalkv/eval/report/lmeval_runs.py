"""Paired comparisons of lm-eval runs (``criticalkv report`` of ``criticalkv lm-eval`` output folders).

lm-eval's ``--log_samples`` writes, per run, ``results_<date>.json`` (its ``config.criticalkv`` names
the method and budget) and one ``samples_<task>_<date>.jsonl`` per task, whose lines carry the
``doc_id`` and each metric's per-sample value. Runs of the same task and limit score the same
documents, so two runs pair by (task, metric, ``doc_id``), as our sweeps pair by sample. Read here:
each run's per-sample scores (the runs of one method and budget on several tasks joined); each
(method, budget)'s mean with its 95% bootstrap interval
(stratified by task and metric); and, paired per document, each compressed run minus the full cache
and each ``critical-X`` minus ``X`` at the same budget (:mod:`criticalkv.eval.report.bootstrap`). A metric
at -1 on every document of a run is one lm-eval did not measure (RULER reports each length it was
not asked for as -1, e.g. ``4096``): it is left out and named.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from criticalkv.eval.report.bootstrap import MIN_PAIRED_SAMPLES, distinguishable, stratified_interval

__all__ = ["LMEvalRun", "find_runs", "format_lmeval_report", "is_lmeval_folder"]

#: lm-eval's value for a metric it did not compute on a document (RULER's lengths not asked for)
NOT_MEASURED = -1.0
_SAMPLES = re.compile(r"^samples_(?P<task>.+)_(?P<date>\d{4}-\d\d-\d\dT[\d.:-]+)\.jsonl$")

#: (task, metric, doc_id): what pairs two runs' samples
Key = tuple[str, str, int]


@dataclass
class LMEvalRun:
    """One lm-eval run: its folder, method and budget, and per-sample scores keyed by (task, metric, doc_id)."""

    folder: Path
    method: str
    budget: float
    kv_ratio: float | None
    scores: dict[Key, float] = field(default_factory=dict)
    unmeasured: set[tuple[str, str]] = field(default_factory=set)


def is_lmeval_folder(folder: Path) -> bool:
    """Whether ``folder`` holds lm-eval output (a ``results_*.json`` beside ``samples_*.jsonl``) at any depth."""
    return any(_SAMPLES.match(p.name) for p in Path(folder).rglob("samples_*.jsonl"))


def _identity(results: dict[str, Any]) -> tuple[str, float, float | None]:
    """(method, budget, kv ratio) of a results file: the criticalkv model's, else lm-eval's own model (full)."""
    ours = (results.get("config") or {}).get("criticalkv")
    if isinstance(ours, dict) and ours.get("method"):
        method = str(ours["method"])
        budget = 1.0 if method == "full" else float(ours.get("budget", math.nan))
        ratio = ours.get("kv_ratio_mean")
        return method, budget, None if ratio is None else float(ratio)
    return "full", 1.0, 1.0


def _read_samples(path: Path, task: str, run: LMEvalRun) -> None:
    values: dict[str, dict[int, float]] = defaultdict(dict)
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        sample = json.loads(line)
        for metric in sample.get("metrics") or []:
            value = sample.get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[str(metric)][int(sample["doc_id"])] = float(value)
    for metric, by_doc in values.items():
        if all(v == NOT_MEASURED for v in by_doc.values()):
            run.unmeasured.add((task, metric))
            continue
        for doc, value in by_doc.items():
            if value != NOT_MEASURED:
                run.scores[(task, metric, doc)] = value


def find_runs(folders: Iterable[Path]) -> list[LMEvalRun]:
    """Every lm-eval run under ``folders``: each folder holding ``results_*.json`` (the latest one, and
    the samples files of its date) is one run."""
    runs = []
    for folder in folders:
        for results_path in sorted({p.parent for p in Path(folder).rglob("results_*.json")}):
            latest = sorted(results_path.glob("results_*.json"))[-1]
            date = latest.stem.removeprefix("results_")
            method, budget, ratio = _identity(json.loads(latest.read_text(encoding="utf-8")))
            run = LMEvalRun(results_path, method, budget, ratio)
            for path in sorted(results_path.glob(f"samples_*_{date}.jsonl")):
                match = _SAMPLES.match(path.name)
                if match:
                    _read_samples(path, match.group("task"), run)
            if run.scores:
                runs.append(run)
    return runs


def merged(runs: Sequence[LMEvalRun]) -> list[LMEvalRun]:
    """One run per (method, budget): the runs of one configuration over several tasks (one folder
    each, as ``benchmarks/lmeval_ruler.py`` writes them) joined; the kv ratio their mean."""
    groups: dict[tuple[str, float], list[LMEvalRun]] = defaultdict(list)
    for run in runs:
        groups[(run.method, run.budget)].append(run)
    out = []
    for (method, budget), members in groups.items():
        ratios = [r.kv_ratio for r in members if r.kv_ratio is not None]
        folder = members[0].folder if len(members) == 1 else Path(f"{len(members)} folders")
        joined = LMEvalRun(folder, method, budget, float(np.mean(ratios)) if ratios else None)
        for run in members:
            joined.scores.update(run.scores)
            joined.unmeasured |= run.unmeasured
        out.append(joined)
    return out


def _by_stratum(scores: dict[Key, float]) -> dict[tuple[str, str], list[float]]:
    strata: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (task, metric, _), value in sorted(scores.items()):
        strata[(task, metric)].append(100 * value)
    return strata


def _mean(strata: dict[tuple[str, str], list[float]]) -> float:
    return float(np.mean([np.mean(v) for v in strata.values()]))


def _paired(mine: LMEvalRun, base: LMEvalRun) -> str:
    """``mine`` minus ``base`` on the documents both scored: points, 95% interval, verdict, counts."""
    shared = sorted(set(mine.scores) & set(base.scores))
    if not shared:
        return "no document scored by both"
    diffs = {k: mine.scores[k] - base.scores[k] for k in shared}
    strata = _by_stratum(diffs)
    low, high = stratified_interval(list(strata.values()))
    if len(shared) < MIN_PAIRED_SAMPLES:
        verdict = f"too few samples to tell (n={len(shared)} < {MIN_PAIRED_SAMPLES})"
    else:
        verdict = "distinguishable from 0" if distinguishable(low, high) else "not distinguishable from 0"
    higher, lower = sum(d > 0 for d in diffs.values()), sum(d < 0 for d in diffs.values())
    return (
        f"score {_mean(strata):+.1f} pts [{low:+.1f}, {high:+.1f}] ({verdict}), n={len(shared)} paired documents "
        f"({higher} scored higher, {lower} lower)"
    )


def _label(run: LMEvalRun) -> str:
    return f"{run.method:<18} @ {run.budget:<5g}"


def format_lmeval_report(runs: Sequence[LMEvalRun]) -> str:
    """Each run's mean score with its interval; each compressed run minus the full cache, and each
    ``critical-X`` minus ``X``, paired per document; the metrics lm-eval did not measure."""
    if not runs:
        raise ValueError("no lm-eval run with per-sample results (run lm-eval with --log_samples)")
    ordered = sorted(merged(runs), key=lambda r: (r.method != "full", r.budget, r.method, str(r.folder)))
    strata = sorted({(t, m) for r in ordered for t, m, _ in r.scores})
    lines = [
        "lm-eval runs (scores in percent, mean over " + ", ".join(f"{t} [{m}]" for t, m in strata) + "):",
        f"{'method':<18}   {'budget':<5} {'score [95% CI]':>22} {'n':>4} {'kv_ratio':>8}  folder",
    ]
    for run in ordered:
        by = _by_stratum(run.scores)
        low, high = stratified_interval(list(by.values()))
        ratio = "-" if run.kv_ratio is None else f"{run.kv_ratio:.3f}"
        score = f"{_mean(by):.1f} [{low:.1f}, {high:.1f}]"
        lines.append(f"{_label(run)} {score:>22} {len(run.scores):>4} {ratio:>8}  {run.folder}")
    full = next((r for r in ordered if r.method == "full"), None)
    if full is None:
        lines += ["", "no full-cache run among these folders: pass one (method=full) to compare against it"]
    else:
        lines += ["", "against the full cache (paired per document, bootstrap 95% CI):"]
        lines += [f"  {_label(r)} {_paired(r, full)}" for r in ordered if r is not full]
    pairs = [(r, b) for r in ordered for b in ordered if b.method == r.method.removeprefix("critical-")
             and r.method.startswith("critical-") and b.budget == r.budget]  # fmt: skip
    if pairs:
        lines += ["", "CriticalKV minus its base at the same budget (paired per document, bootstrap 95% CI):"]
        lines += [f"  {_label(r)} {_paired(r, b)}" for r, b in pairs]
    unmeasured = sorted({u for r in ordered for u in r.unmeasured})
    if unmeasured:
        names = ", ".join(f"{t} [{m}]" for t, m in unmeasured)
        lines += ["", f"not measured (-1 on every document; e.g. a RULER length not asked for), left out: {names}"]
    return "\n".join(lines)
