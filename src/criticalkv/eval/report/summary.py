"""A sweep's summary rows, with every comparison between two methods paired by sample.

A folder may hold a different number of samples per method (sweeps merged into one folder,
an interrupted run). Each row says how many samples it averages (``n``); the compression loss
of a method against the full cache, and CriticalKV's loss reduction against its base method, are
computed only over the samples both (all three) have.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from criticalkv.eval.report.bootstrap import cell_intervals

AVERAGE = "average"

#: (task, length, index) of a result
SampleId = tuple[str, int, int]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def sample_id(record: Mapping[str, Any]) -> SampleId:
    """The sample a result line belongs to."""
    return str(record["task"]), int(record["length"]), int(record["index"])


def task_mean(scores: Mapping[SampleId, float], within: Collection[SampleId] | None = None) -> float:
    """The average over tasks of each task's mean score (RULER's average), over ``within`` if given."""
    per_task: dict[str, list[float]] = defaultdict(list)
    for sample, score in scores.items():
        if within is None or sample in within:
            per_task[sample[0]].append(score)
    return _mean([_mean(v) for v in per_task.values()])


def base_of(method: str) -> str | None:
    """``critical-adakv`` -> ``adakv``; ``None`` for a non-critical method."""
    return method[len("critical-") :] if method.startswith("critical-") else None


def paired_loss(row: Mapping[str, Any], full: Mapping[str, Any] | None) -> tuple[float, int]:
    """(compression loss ``(full - score) / full``, samples compared) of ``row`` over the samples
    that it and the full-cache row ``full`` both have."""
    if full is None:
        return math.nan, 0
    common = row["_scores"].keys() & full["_scores"].keys()
    ref = task_mean(full["_scores"], common)
    return ((ref - task_mean(row["_scores"], common)) / ref if ref else math.nan), len(common)


def _fill_losses(rows: list[dict[str, Any]]) -> None:
    full = {(r["length"], r["task"]): r for r in rows if r["method"] == "full"}
    for r in rows:
        r["loss"], r["loss_n"] = paired_loss(r, full.get((r["length"], r["task"])))


def summary_rows(groups: Mapping[tuple[str, str, Any, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per ``(length, method, budget, task)`` group of result lines (one line per key),
    scores in percent, with its per-sample scores under ``_scores`` (not written to the CSV)."""
    full_nll = {sample_id(r): r["nll"] for items in groups.values() for r in items if r["method"] == "full"}
    rows = []
    for (length, method, budget, task), items in groups.items():
        scores = {sample_id(r): float(r["score"]) for r in items}
        deltas = [r["nll"] - full_nll[s] for r in items if (s := sample_id(r)) in full_nll]
        rows.append(
            {
                "length": length,
                "method": method,
                "budget": budget,
                "task": task,
                "n": len(items),
                "score": 100 * task_mean(scores),
                "partial": 100 * _mean([r["partial"] for r in items]),
                "nll": _mean([r["nll"] for r in items]),
                "nll_increase": _mean(deltas),
                "kl": _mean([r["kl"] for r in items]),
                "top1": _mean([r["top1"] for r in items]),
                "kv_ratio": _mean([r["kv_bytes"] / r["kv_bytes_full"] for r in items]),
                **cell_intervals(items, deltas, by_task=task == AVERAGE),
                "_scores": scores,
            }
        )
    _fill_losses(rows)
    return rows


def loss_reductions(rows: Sequence[dict[str, Any]], length: str = "all") -> list[dict[str, Any]]:
    """For each Critical* method and budget: ``1 - loss_critical / loss_base`` on the average,
    both losses over the samples that the critical method, its base and the full cache all have
    (``n``)."""
    avg = {(r["method"], r["budget"]): r for r in rows if r["task"] == AVERAGE and r["length"] == length}
    full = avg.get(("full", 1.0)) or next((r for (m, _), r in avg.items() if m == "full"), None)
    out = []
    for (method, budget), r in sorted(avg.items(), key=lambda kv: (kv[0][0], float(kv[0][1]))):
        base = base_of(method)
        if base is None or (base, budget) not in avg or full is None:
            continue
        common = r["_scores"].keys() & avg[(base, budget)]["_scores"].keys() & full["_scores"].keys()
        ref = task_mean(full["_scores"], common)
        lb = (ref - task_mean(avg[(base, budget)]["_scores"], common)) / ref if ref else math.nan
        lc = (ref - task_mean(r["_scores"], common)) / ref if ref else math.nan
        red = 1 - lc / lb if lb and not math.isnan(lb) and lb > 0 else math.nan
        out.append(
            {
                "method": method,
                "base": base,
                "budget": budget,
                "loss_base": lb,
                "loss_critical": lc,
                "reduction": red,
                "n": len(common),
            }
        )
    return out
