"""Summaries, tables and plots of a sweep, from its folder alone (``results.jsonl``, ``skipped.jsonl``).

The report counts one line per result key (the last, see
:func:`~criticalkv.eval.results.current_results`), prints each cell's sample count, and compares
two methods only over the samples both have (:mod:`criticalkv.eval.report.summary`).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from criticalkv.eval.report.bootstrap import (
    INTERVAL_COLUMNS,
    describe_difference,
    paired_against_full,
    paired_differences,
)
from criticalkv.eval.report.summary import AVERAGE, base_of, loss_reductions, summary_rows
from criticalkv.eval.results import RESULTS, current_results, read_results, read_skipped, sample_key
from criticalkv.plotting import pyplot
from criticalkv.runs import write_atomically

logger = logging.getLogger(__name__)

__all__ = ["AVERAGE", "base_of", "build_report", "format_tables", "loss_reductions", "plot", "summarise", "write_csv"]
FIELDS = [
    "length",
    "method",
    "budget",
    "task",
    "n",
    "score",
    "partial",
    "loss",
    "loss_n",
    "nll",
    "nll_increase",
    "kl",
    "top1",
    "kv_ratio",
]
# each measured column is followed by its 95% bootstrap interval (criticalkv.eval.report.bootstrap)
FIELDS = [c for f in FIELDS for c in (f, *INTERVAL_COLUMNS.get(f, ()))]


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

    ``records`` hold one line per key (:func:`~criticalkv.eval.results.current_results`). ``n`` is
    the samples a row averages; ``loss`` the compression loss (full - score) / full over the
    ``loss_n`` samples the row and the full cache both have; ``nll_increase`` the mean per-sample
    increase of the gold answer's NLL over the full cache. With ``by="bucket"`` the ``length``
    column holds LongBench-E's bucket (0-4k, 4-8k, 8k+, by the sample's LongBench length in words
    or characters) instead of the sweep length. A sweep of one length has only the ``all`` rows
    (its rows of that length would repeat them).
    """
    groups: dict[tuple[str, str, Any, str], list[dict[str, Any]]] = defaultdict(list)
    several = by != "length" or len({_group(r, by) for r in records}) > 1  # one length: its rows are "all"'s
    for r in records:
        for length in ("all", _group(r, by)) if several else ("all",):
            groups[(length, r["method"], r["budget"], r["task"])].append(r)
            groups[(length, r["method"], r["budget"], AVERAGE)].append(r)
    rows = summary_rows(groups)
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


def write_csv(rows: Sequence[dict[str, Any]], path: Path, group: str = "length") -> None:
    """``rows`` as CSV (written whole or not at all, :func:`~criticalkv.runs.write_atomically`); ``group``
    names the first column (``bucket`` for LongBench-E buckets)."""
    fields = [group if f == "length" else f for f in FIELDS]

    def write(temporary: Path) -> None:
        with temporary.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            for r in rows:
                cells = {(group if k == "length" else k): v for k, v in r.items()}
                writer.writerow(
                    {k: (f"{v:.4f}" if isinstance(v, float) and k != "budget" else v) for k, v in cells.items()}
                )

    write_atomically(path, write)


def _cell(row: dict[str, Any] | None, width: int) -> str:
    """``score(n)`` right-aligned, or ``-`` for no results."""
    return f"{row['score']:.1f}({row['n']})".rjust(width) if row else "-".rjust(width)


def format_tables(
    rows: Sequence[dict[str, Any]], length: str = "all", records: Sequence[dict[str, Any]] | None = None
) -> str:
    """Score per task and average per (method, budget), each as ``score(n samples)``; the loss
    against the full cache (over the samples both have, their count beside it), NLL increase;
    then loss reductions (over the samples the method, its base and the full cache all have; with
    ``records``, the paired bootstrap interval of each Critical-X minus X difference)."""
    sel = [r for r in rows if r["length"] == length]
    tasks = sorted({r["task"] for r in sel if r["task"] != AVERAGE})
    configs = sorted({(r["method"], r["budget"]) for r in sel}, key=lambda mb: (mb[0] != "full", float(mb[1]), mb[0]))
    by = {(r["method"], r["budget"], r["task"]): r for r in sel}
    short = [
        t.replace("niah_", "").replace("single", "s").replace("multikey", "mk").replace("multi", "m") for t in tasks
    ]
    widths = [max(10, len(s)) for s in short]
    head = (
        f"{'method':<18}{'budget':>7} "
        + " ".join(f"{s:>{w}}" for s, w in zip(short, widths, strict=True))
        + f" {'avg(n)':>11} {'loss(n)':>12} {'dNLL':>7} {'top1':>6}"
    )
    lines = [head, "-" * len(head)]
    for method, budget in configs:
        cells = [by.get((method, budget, t)) for t in tasks]
        avg = by[(method, budget, AVERAGE)]
        loss = f"{avg['loss']:.3f}({avg['loss_n']})"
        lines.append(
            f"{method:<18}{budget!s:>7} "
            + " ".join(_cell(c, w) for c, w in zip(cells, widths, strict=True))
            + f" {_cell(avg, 11)} {loss:>12} {avg['nll_increase']:>7.3f} {avg['top1']:>6.3f}"
        )
    if records is not None:
        lines += _against_full(records, length)
    reductions = loss_reductions(rows, length)
    if reductions:
        lines += ["", "loss reduction of CriticalKV vs its base (1 - loss_critical / loss_base), on shared samples:"]
        paired = paired_differences(records, length) if records is not None else {}
        for r in reductions:
            lines.append(
                f"  {r['method']:<18} @ {r['budget']!s:<5} base loss {r['loss_base']:.3f} -> {r['loss_critical']:.3f}"
                f"  {_reduction(r['reduction'], r['loss_base'])}  (n={r['n']})"
            )
            if (r["method"], r["budget"]) in paired:
                lines.append(f"    minus base, 95% CI: {describe_difference(paired[(r['method'], r['budget'])])}")
    return "\n".join(lines)


def _reduction(reduction: float, loss_base: float) -> str:
    """``reduction 0.42``, or why there is none (a base that loses nothing has nothing to reduce)."""
    if not math.isnan(reduction):
        return f"reduction {reduction:.2f}"
    if math.isnan(loss_base):
        return "reduction - (the full cache scores 0 on these samples: no loss is defined)"
    return "reduction - (the base loses nothing, or gains, on these samples: nothing to reduce)"


def _against_full(records: Sequence[dict[str, Any]], length: str) -> list[str]:
    """Each compressed (method, budget) minus the full cache, paired per sample, with 95% intervals."""
    paired = paired_against_full(records, length)
    if not paired:
        return []
    lines = ["", "against the full cache (method minus full on the samples both ran, paired bootstrap 95% CI):"]
    for (method, budget), diff in sorted(paired.items(), key=lambda kv: (float(kv[0][1]), kv[0][0])):
        lines.append(f"  {method:<18} @ {budget!s:<5} {describe_difference(diff)}")
    return lines


def _skipped_note(out_dir: Path, records: Sequence[dict[str, Any]]) -> str:
    """A line counting the samples the sweep skipped and never computed (e.g. too long)."""
    computed = {sample_key(r) for r in records}
    skipped = [s for s in read_skipped(out_dir) if sample_key(s) not in computed]
    if not skipped:
        return ""
    lines = []
    for reason, phrase in SKIP_REASONS.items():
        these = [s for s in skipped if s.get("reason", "too long") == reason]
        if not these:
            continue
        where = ", ".join(f"{s['task']} line {(s.get('meta') or {}).get('line', s['index'])}" for s in these[:10])
        more = f" and {len(these) - 10} more" if len(these) > 10 else ""
        see = out_dir / "skipped.jsonl"
        lines.append(f"skipped {len(these)} sample(s) {phrase} (not in the table): {where}{more} (see {see})")
    return "\n\n" + "\n".join(lines) if lines else ""


#: why a sample was skipped (``skipped.jsonl``'s ``reason``) and how the report says it
SKIP_REASONS = {
    "too long": "longer than the model accepts",
    "too short": "too short for the budget and observation window",
    "unusable": "on lines that are not usable samples (malformed, or a blank answer)",
}


def plot_title(out_dir: Path, rows: Sequence[dict[str, Any]], lengths: Sequence[str] = ()) -> str:
    """What a sweep's figures show: benchmark, model, context lengths (``lengths``, else those of
    ``rows``), mode and samples (n) per point."""
    identity: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        identity = dict(json.loads((Path(out_dir) / "run.json").read_text(encoding="utf-8")).get("identity", {}))
    lengths = sorted(
        set(lengths) or {str(r["length"]) for r in rows if r["length"] != "all"}, key=lambda x: (len(x), x)
    )
    shown = "own lengths" if lengths == ["0"] else f"{'/'.join(lengths)} tokens"
    avg = [r for r in rows if r["length"] == "all" and r["task"] == AVERAGE]
    counts = sorted({int(r["n"]) for r in avg if r.get("n") is not None})
    n = "-" if not counts else str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    parts = [identity.get("dataset") or identity.get("benchmark"), identity.get("model"), shown, identity.get("mode")]
    return ", ".join(str(p) for p in parts if p) + f", n = {n} per point"


def plot(rows: Sequence[dict[str, Any]], out_dir: Path, bar_budget: float | None = None, title: str = "") -> list[Path]:
    """score_vs_budget.png, nll_vs_budget.png and tasks_at_budget.png (each titled ``title``) of
    :mod:`criticalkv.eval.report.figures`: every point with its 95% interval, the full cache's level
    and interval, every method in its colour, marker and line style of
    :func:`~criticalkv.plotting.method_style`."""
    from criticalkv.eval.report.figures import budget_figure, chosen_budget, tasks_figure

    plt = pyplot()
    paths = []
    figures = [
        ("score_vs_budget.png", budget_figure(rows, "score", title)),
        ("nll_vs_budget.png", budget_figure(rows, "nll_increase", title)),
    ]
    chosen = chosen_budget(rows, bar_budget)
    if chosen is not None:
        figures.append(("tasks_at_budget.png", tasks_figure(rows, chosen, title)))
    for name, fig in figures:
        write_atomically(out_dir / name, functools.partial(fig.savefig, dpi=120, bbox_inches="tight"))
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def build_report(out_dir: Path, bar_budget: float | None = None, buckets: bool = False) -> tuple[str, list[Path]]:
    """Write summary.csv and the plots of ``out_dir``; return the printed tables and plot paths.

    ``buckets``: also group LongBench(-E) results by length bucket (``summary_buckets.csv`` and
    one table per bucket).
    """
    out_dir = Path(out_dir)
    records = current_results(read_results(out_dir), out_dir / RESULTS)
    note = _skipped_note(out_dir, records)
    if not records:
        raise ValueError(f"{out_dir} has no results yet (no usable line in {out_dir / RESULTS}){note}")
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
    title = plot_title(out_dir, rows, sorted({str(r["length"]) for r in records}))
    return text + note, plot(rows, out_dir, bar_budget, title)
