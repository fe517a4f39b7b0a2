"""Bootstrap intervals of the report: against a loop-based percentile bootstrap, coverage of a known
mean, paired Critical-X minus X differences, and the summary columns."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from criticalkv.eval.report import (
    FIELDS,
    MIN_PAIRED_SAMPLES,
    cell_intervals,
    describe_difference,
    distinguishable,
    format_tables,
    paired_differences,
    stratified_interval,
    summarise,
)


def _loop_interval(strata: list[list[float]], resamples: int, seed: int) -> tuple[float, float]:
    """The same draws as stratified_interval, one resample at a time."""
    rng = np.random.default_rng(seed)
    picks = [rng.integers(0, len(s), size=(resamples, len(s))) for s in strata]
    means = []
    for i in range(resamples):
        means.append(sum(sum(s[j] for j in p[i]) / len(s) for s, p in zip(strata, picks, strict=True)) / len(strata))
    means.sort()
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def test_interval_matches_a_loop_over_resamples() -> None:
    strata = [[0.0, 1.0, 1.0, 0.5], [2.0, 3.0, 2.5]]
    assert stratified_interval(strata, resamples=300, seed=7) == pytest.approx(_loop_interval(strata, 300, 7))


def test_interval_is_seeded_contains_the_mean_and_shrinks_with_n() -> None:
    gen = random.Random(0)
    small = [gen.gauss(1.0, 1.0) for _ in range(10)]
    large = [gen.gauss(1.0, 1.0) for _ in range(1000)]
    assert stratified_interval([small]) == stratified_interval([small])
    low, high = stratified_interval([small])
    assert low < sum(small) / len(small) < high
    big_low, big_high = stratified_interval([large])
    assert big_low < 1.0 < big_high and big_high - big_low < (high - low) / 3


def test_constant_and_empty_cells() -> None:
    assert stratified_interval([[0.5, 0.5, 0.5]]) == (0.5, 0.5)
    assert all(math.isnan(v) for v in stratified_interval([[]]))
    with pytest.raises(ValueError, match="level"):
        stratified_interval([[1.0]], level=1.5)
    with pytest.raises(ValueError, match="resamples"):
        stratified_interval([[1.0]], resamples=0)


def _record(method: str, budget: Any, task: str, index: int, score: float, nll: float) -> dict[str, Any]:
    return {
        "method": method,
        "budget": budget,
        "task": task,
        "length": 512,
        "index": index,
        "score": score,
        "partial": score,
        "nll": nll,
        "kl": 0.0,
        "top1": 1.0 - nll / 10,
        "kv_bytes": 1,
        "kv_bytes_full": 5,
    }


def _records() -> list[dict[str, Any]]:
    gen = random.Random(1)
    out = []
    for task in ("a", "b"):
        for i in range(12):
            out.append(_record("full", 1.0, task, i, 1.0, 1.0))
            base = float(gen.random() < 0.4)
            out.append(_record("snapkv", 0.2, task, i, base, 2.0 + gen.random()))
            out.append(_record("critical-snapkv", 0.2, task, i, max(base, float(gen.random() < 0.9)), 1.5))
    return out


def test_paired_difference_of_a_clear_gain_is_distinguishable() -> None:
    diff = paired_differences(_records())[("critical-snapkv", 0.2)]
    assert diff["n"] == 24 and diff["score_diff"] > 0 and diff["nll_diff"] < 0
    assert distinguishable(diff["score_diff_low"], diff["score_diff_high"])
    assert diff["nll_diff_high"] < 0
    assert "score +" in describe_difference(diff) and "distinguishable from 0" in describe_difference(diff)


def test_paired_difference_uses_only_shared_samples() -> None:
    records = [r for r in _records() if not (r["method"] == "snapkv" and r["index"] >= 6)]
    diff = paired_differences(records)[("critical-snapkv", 0.2)]
    assert diff["n"] == 12
    same = [_record(m, 0.2, "a", i, 0.5, 1.0) for m in ("snapkv", "critical-snapkv") for i in range(MIN_PAIRED_SAMPLES)]
    zero = paired_differences(same)[("critical-snapkv", 0.2)]
    assert zero["score_diff_low"] == zero["score_diff_high"] == 0.0
    assert "not distinguishable from 0" in describe_difference(zero)


def test_too_few_paired_samples_draw_no_verdict_but_keep_the_interval() -> None:
    # two samples with a large, consistent gain: the bootstrap interval excludes 0, yet 2 values say nothing
    few = [r for r in _records() if r["task"] == "a" and r["index"] < 2]
    for r in few:
        if r["method"] == "critical-snapkv":
            r["score"], r["nll"] = 1.0, 0.5
        elif r["method"] == "snapkv":
            r["score"] = 0.0
    diff = paired_differences(few)[("critical-snapkv", 0.2)]
    assert diff["n"] == 2 and distinguishable(diff["score_diff_low"], diff["score_diff_high"])
    line = describe_difference(diff)
    assert "too few samples to tell (n=2" in line and "distinguishable" not in line
    assert f"[{diff['score_diff_low']:+.1f}, {diff['score_diff_high']:+.1f}]" in line
    assert "distinguishable from 0" in describe_difference(diff, min_samples=2)
    enough = paired_differences(_records())[("critical-snapkv", 0.2)]
    assert enough["n"] >= MIN_PAIRED_SAMPLES and "too few" not in describe_difference(enough)


def test_summary_rows_carry_intervals_around_their_values() -> None:
    rows = summarise(_records())
    for name in ("score", "nll_increase", "top1"):
        assert f"{name}_ci_low" in FIELDS and f"{name}_ci_high" in FIELDS
    for row in rows:
        for name in ("score", "nll_increase", "top1"):
            low, high = row[f"{name}_ci_low"], row[f"{name}_ci_high"]
            assert low - 1e-9 <= row[name] <= high + 1e-9, (row, name)
    text = format_tables(rows, records=_records())
    assert "minus base, 95% CI: score" in text


def test_cell_intervals_stratify_the_average_by_task() -> None:
    items = [_record("x", 0.2, "a", i, 1.0, 1.0) for i in range(3)] + [_record("x", 0.2, "b", 0, 0.0, 1.0)]
    by_task = cell_intervals(items, [0.0] * 4, by_task=True)
    assert by_task["score_ci_low"] == by_task["score_ci_high"] == 50.0  # each task's mean is fixed
    pooled = cell_intervals(items, [0.0] * 4, by_task=False)
    assert pooled["score_ci_low"] < pooled["score_ci_high"]
