"""Summaries, tables and plots of a sweep, from ``results.jsonl`` alone."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from criticalkv.eval.bootstrap import INTERVAL_COLUMNS, cell_intervals, describe_difference, paired_differences
from criticalkv.eval.store import read_results
from criticalkv.plotting import pyplot

AVERAGE = "average"
FIELDS = [
    "length",
    "method",
    "budget",
    "task",
    "n",
    "score",
    "partial",
    "loss",
    "nll",
    "nll_increase",
    "kl",
    "top1",
    "kv_ratio",
]
# each measured column is followed by its 95% bootstrap interval (criticalkv.eval.bootstrap)
FIELDS = [c for f in FIELDS for c in (f, *INTERVAL_COLUMNS.get(f, ()))]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def base_of(method: str) -> str | None:
    """``critical-adakv`` -> ``adakv``; ``None`` for a non-critical method."""
    return method[len("critical-") :] if method.startswith("critical-") else None


def _group(record: dict[str, Any], by: str) -> str:
    """The group of a result: its length, or (``by="bucket"``) its LongBench-E length bucket."""
    if by == "length":
        return str(record["length"])
    if by == "bucket":
        from criticalkv.eval.longbench.buckets import bucket_of

        length = (record.get("meta") or {}).get("length")
        if not isinstance(length, int):
            raise ValueError("grouping by LongBench-E bucket needs LongBench results (their meta has 'length')")
        return bucket_of(length)
    raise ValueError(f"group results by 'length' or 'bucket', not {by!r}")


def summarise(records: Sequence[dict[str, Any]], by: str = "length") -> list[dict[str, Any]]:
    """One row per (length or 'all', method, budget, task or 'average'), scores in percent.

    ``loss`` is the compression loss (full - score) / full on the same subset;
    ``nll_increase`` the mean per-sample increase of the gold answer's NLL over the full cache.
    With ``by="bucket"`` the ``length`` column holds LongBench-E's bucket (0-4k, 4-8k, 8k+, by the
    sample's LongBench length in words or characters) instead of the sweep length.
    """
    full_nll = {(r["task"], r["length"], r["index"]): r["nll"] for r in records if r["method"] == "full"}
    groups: dict[tuple[str, str, Any, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        for length in ("all", _group(r, by)):
            groups[(length, r["method"], r["budget"], r["task"])].append(r)
            groups[(length, r["method"], r["budget"], AVERAGE)].append(r)
    rows = []
    for (length, method, budget, task), items in groups.items():
        deltas = [r["nll"] - full_nll[k] for r in items if (k := (r["task"], r["length"], r["index"])) in full_nll]
        if task == AVERAGE:  # average of per-task means, as RULER reports
            per_task: dict[str, list[float]] = defaultdict(list)
            for r in items:
                per_task[r["task"]].append(r["score"])
            score = _mean([_mean(v) for v in per_task.values()])
        else:
            score = _mean([r["score"] for r in items])
        rows.append(
            {
                "length": length,
                "method": method,
                "budget": budget,
                "task": task,
                "n": len(items),
                "score": 100 * score,
                "partial": 100 * _mean([r["partial"] for r in items]),
                "nll": _mean([r["nll"] for r in items]),
                "nll_increase": _mean(deltas),
                "kl": _mean([r["kl"] for r in items]),
                "top1": _mean([r["top1"] for r in items]),
                "kv_ratio": _mean([r["kv_bytes"] / r["kv_bytes_full"] for r in items]),
                **cell_intervals(items, deltas, by_task=task == AVERAGE),
            }
        )
    full_score = {(r["length"], r["task"]): r["score"] for r in rows if r["method"] == "full"}
    for r in rows:
        ref = full_score.get((r["length"], r["task"]))
        r["loss"] = (ref - r["score"]) / ref if ref else math.nan
    rows.sort(
        key=lambda r: (
            r["length"] != "all",
            r["length"],
            r["method"],
            float(r["budget"]),
            r["task"] == AVERAGE,
            r["task"],
        )
    )
    return rows


def loss_reductions(rows: Sequence[dict[str, Any]], length: str = "all") -> list[dict[str, Any]]:
    """For each Critical* method and budget: 1 - loss_critical / loss_base on the average."""
    avg = {(r["method"], r["budget"]): r for r in rows if r["task"] == AVERAGE and r["length"] == length}
    out = []
    for (method, budget), r in sorted(avg.items(), key=lambda kv: (kv[0][0], float(kv[0][1]))):
        base = base_of(method)
        if base is None or (base, budget) not in avg:
            continue
        lb, lc = avg[(base, budget)]["loss"], r["loss"]
        red = 1 - lc / lb if lb and not math.isnan(lb) and lb > 0 else math.nan
        out.append(
            {"method": method, "base": base, "budget": budget, "loss_base": lb, "loss_critical": lc, "reduction": red}
        )
    return out


def write_csv(rows: Sequence[dict[str, Any]], path: Path, group: str = "length") -> None:
    """``rows`` as CSV; ``group`` names the first column (``bucket`` for LongBench-E buckets)."""
    fields = [group if f == "length" else f for f in FIELDS]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            cells = {(group if k == "length" else k): v for k, v in r.items()}
            writer.writerow(
                {k: (f"{v:.4f}" if isinstance(v, float) and k != "budget" else v) for k, v in cells.items()}
            )


def format_tables(
    rows: Sequence[dict[str, Any]], length: str = "all", records: Sequence[dict[str, Any]] | None = None
) -> str:
    """Score per task and average per (method, budget), loss, NLL increase; then loss reductions
    (with ``records``: and the paired bootstrap interval of each Critical-X minus X difference)."""
    sel = [r for r in rows if r["length"] == length]
    tasks = sorted({r["task"] for r in sel if r["task"] != AVERAGE})
    configs = sorted({(r["method"], r["budget"]) for r in sel}, key=lambda mb: (mb[0] != "full", float(mb[1]), mb[0]))
    by = {(r["method"], r["budget"], r["task"]): r for r in sel}
    short = [
        t.replace("niah_", "").replace("single", "s").replace("multikey", "mk").replace("multi", "m") for t in tasks
    ]
    widths = [max(8, len(s)) for s in short]
    head = (
        f"{'method':<18}{'budget':>7} "
        + " ".join(f"{s:>{w}}" for s, w in zip(short, widths, strict=True))
        + f" {'avg':>7} {'loss':>7} {'dNLL':>7} {'top1':>6}"
    )
    lines = [head, "-" * len(head)]
    for method, budget in configs:
        cells = [by.get((method, budget, t)) for t in tasks]
        avg = by[(method, budget, AVERAGE)]
        lines.append(
            f"{method:<18}{budget!s:>7} "
            + " ".join(f"{c['score']:>{w}.1f}" if c else f"{'-':>{w}}" for c, w in zip(cells, widths, strict=True))
            + f" {avg['score']:>7.1f} {avg['loss']:>7.3f} {avg['nll_increase']:>7.3f} {avg['top1']:>6.3f}"
        )
    reductions = loss_reductions(rows, length)
    if reductions:
        lines += ["", "loss reduction of CriticalKV vs its base (1 - loss_critical / loss_base):"]
        paired = paired_differences(records, length) if records is not None else {}
        for r in reductions:
            lines.append(
                f"  {r['method']:<18} @ {r['budget']!s:<5} base loss {r['loss_base']:.3f} -> {r['loss_critical']:.3f}"
                f"  reduction {r['reduction']:.2f}"
            )
            if (r["method"], r["budget"]) in paired:
                lines.append(f"    minus base, 95% CI: {describe_difference(paired[(r['method'], r['budget'])])}")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], out_dir: Path, bar_budget: float | None = None) -> list[Path]:
    """score_vs_budget.png, tasks_at_budget.png, nll_vs_budget.png."""
    plt = pyplot()

    avg = [r for r in rows if r["length"] == "all" and r["task"] == AVERAGE]
    methods = [m for m in dict.fromkeys(r["method"] for r in avg) if m != "full"]
    full = next((r for r in avg if r["method"] == "full"), None)
    paths = []
    for key, ylabel, name in (
        ("score", "average score", "score_vs_budget.png"),
        ("nll_increase", "NLL increase over full (nats/token)", "nll_vs_budget.png"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for m in methods:
            pts = sorted((float(r["budget"]), r[key]) for r in avg if r["method"] == m)
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], "-" if m.startswith("critical") else "--", marker="o", label=m
            )
        if full is not None and key == "score":
            ax.axhline(full["score"], color="black", linestyle=":", label="full cache")
        ax.set_xlabel("KV budget (fraction of the compressed prompt)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
        paths.append(out_dir / name)
    budgets = sorted({float(r["budget"]) for r in avg if r["method"] != "full"})
    if budgets:
        chosen = bar_budget if bar_budget is not None else budgets[len(budgets) // 2]
        per_task = [r for r in rows if r["length"] == "all" and r["task"] != AVERAGE]
        tasks = sorted({r["task"] for r in per_task})
        shown = ["full", *methods] if full is not None else methods
        fig, ax = plt.subplots(figsize=(max(7, len(tasks) * 0.9), 4.2))
        width = 0.8 / max(len(shown), 1)
        for j, m in enumerate(shown):
            vals = []
            for t in tasks:
                match = [
                    r
                    for r in per_task
                    if r["method"] == m and r["task"] == t and (m == "full" or float(r["budget"]) == chosen)
                ]
                vals.append(match[0]["score"] if match else 0.0)
            ax.bar([i + j * width for i in range(len(tasks))], vals, width, label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(f"score at budget {chosen}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "tasks_at_budget.png", dpi=120)
        plt.close(fig)
        paths.append(out_dir / "tasks_at_budget.png")
    return paths


def build_report(out_dir: Path, bar_budget: float | None = None, buckets: bool = False) -> tuple[str, list[Path]]:
    """Write summary.csv and the plots of ``out_dir``; return the printed tables and plot paths.

    ``buckets``: also group LongBench(-E) results by length bucket (``summary_buckets.csv`` and
    one table per bucket).
    """
    records = read_results(out_dir)
    if not records:
        raise ValueError(f"{out_dir} has no results yet (no {out_dir / 'results.jsonl'})")
    rows = summarise(records)
    write_csv(rows, out_dir / "summary.csv")
    text = format_tables(rows, records=records)
    lengths = sorted({r["length"] for r in rows if r["length"] != "all"}, key=int)
    if len(lengths) > 1:
        for length in lengths:
            text += f"\n\n[length {length}]\n" + format_tables(rows, length, records)
    if buckets:
        from criticalkv.eval.longbench.buckets import BUCKETS

        by_bucket = summarise(records, by="bucket")
        write_csv(by_bucket, out_dir / "summary_buckets.csv", group="bucket")
        for bucket in BUCKETS:
            if any(r["length"] == bucket for r in by_bucket):
                text += f"\n\n[LongBench-E bucket {bucket}]\n" + format_tables(by_bucket, bucket)
    return text, plot(rows, out_dir, bar_budget)
