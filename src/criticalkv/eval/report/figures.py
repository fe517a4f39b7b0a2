"""The figures of a sweep's report (``criticalkv eval``, ``criticalkv report``), built from its summary rows.

Each figure shows every point with its 95% bootstrap interval (the summary's ``*_ci_low`` and
``*_ci_high``), the full cache's level (and, for the score, its interval), one x tick per budget
measured, the points of one budget side by side (so coinciding methods stay visible), a y axis that
starts at zero, and the legend beside the plot, where it covers nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from criticalkv.eval.report.bootstrap import INTERVAL_COLUMNS
from criticalkv.eval.report.summary import AVERAGE
from criticalkv.plotting import category_axis, dodged, legend_outside, method_style, pyplot, wrapped

__all__ = ["budget_figure", "chosen_budget", "tasks_figure"]

#: the y-axis label of each plotted summary column
LABELS = {
    "score": "average score (%, 95% CI)",
    "nll_increase": "NLL increase over the full cache (nats/token, 95% CI)",
}
BUDGET_LABEL = "KV budget (fraction of the compressed prompt); points of one budget set side by side"


def _averages(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["length"] == "all" and r["task"] == AVERAGE]


def _whiskers(items: Sequence[dict[str, Any]], key: str) -> list[list[float]]:
    """The lower and upper error-bar lengths of ``key`` (0 where an interval is unknown)."""
    low_key, high_key = INTERVAL_COLUMNS[key]

    def gap(value: Any) -> float:
        return 0.0 if value is None or math.isnan(float(value)) else max(float(value), 0.0)

    return [
        [gap(r[key] - r.get(low_key, math.nan)) for r in items],
        [gap(r.get(high_key, math.nan) - r[key]) for r in items],
    ]


def _full_level(ax: Any, full: dict[str, Any] | None, key: str) -> None:
    """The full cache: its score and interval band, or the zero line of an increase over it."""
    if full is None:
        return
    if key == "score":
        low, high = (full.get(c, math.nan) for c in INTERVAL_COLUMNS["score"])
        if not (math.isnan(low) or math.isnan(high)):
            ax.axhspan(low, high, color="black", alpha=0.08, zorder=0, label="full cache, 95% CI")
        ax.axhline(full["score"], color="black", linestyle=":", zorder=1, label=f"full cache ({full['score']:.1f})")
    else:
        ax.axhline(0.0, color="black", linestyle=":", zorder=1, label="full cache (0 by definition)")


def budget_figure(rows: Sequence[dict[str, Any]], key: str, title: str) -> Any:
    """``key`` (``score`` or ``nll_increase``) of every method's average against the budget."""
    plt = pyplot()
    avg = _averages(rows)
    methods = [m for m in dict.fromkeys(r["method"] for r in avg) if m != "full"]
    full = next((r for r in avg if r["method"] == "full"), None)
    budgets = sorted({float(r["budget"]) for r in avg if r["method"] != "full"})
    fig, ax = plt.subplots(figsize=(7.8, 4.4))
    x = category_axis(ax, budgets, BUDGET_LABEL)
    _full_level(ax, full, key)
    for j, method in enumerate(methods):
        items = sorted((r for r in avg if r["method"] == method), key=lambda r: float(r["budget"]))
        xs = [dodged(x[float(r["budget"])], j, len(methods)) for r in items]
        ax.errorbar(
            xs, [r[key] for r in items], yerr=_whiskers(items, key), capsize=3, label=method, **method_style(method)
        )
    _y_from_zero(ax, avg, key)
    ax.set_ylabel(LABELS[key])
    ax.set_title(wrapped(title, 70), fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    legend_outside(ax)
    fig.tight_layout()
    return fig


def _y_from_zero(ax: Any, avg: Sequence[dict[str, Any]], key: str) -> None:
    """A y axis from 0 (scores: 0 to 100), never one that starts near the data and magnifies noise."""
    if key == "score":
        ax.set_ylim(0.0, 102.0)
        return
    low_key, high_key = INTERVAL_COLUMNS[key]
    values = [float(r[c]) for r in avg for c in (key, low_key, high_key) if r.get(c) is not None]
    finite = [v for v in values if not math.isnan(v)] or [0.0]
    bottom, top = min(0.0, *finite), max(0.0, *finite)
    pad = 0.05 * (top - bottom or 1.0)
    ax.set_ylim(bottom - (pad if bottom < 0 else 0.0), top + pad)


def chosen_budget(rows: Sequence[dict[str, Any]], bar_budget: float | None) -> float | None:
    """The budget of the per-task figure: ``bar_budget``, else the middle one measured (``None``: none)."""
    budgets = sorted({float(r["budget"]) for r in _averages(rows) if r["method"] != "full"})
    if not budgets:
        return None
    return bar_budget if bar_budget is not None else budgets[len(budgets) // 2]


def tasks_figure(rows: Sequence[dict[str, Any]], chosen: float, title: str) -> Any:
    """Each task's score per method at the budget ``chosen`` (the full cache beside them), with intervals."""
    plt = pyplot()
    per_task = [r for r in rows if r["length"] == "all" and r["task"] != AVERAGE]
    tasks = sorted({r["task"] for r in per_task})
    methods = [m for m in dict.fromkeys(r["method"] for r in _averages(rows)) if m != "full"]
    shown = (["full"] if any(r["method"] == "full" for r in per_task) else []) + methods
    fig, ax = plt.subplots(figsize=(max(7.0, len(tasks) * 0.9) + 2.0, 4.4))
    width = 0.8 / max(len(shown), 1)
    for j, method in enumerate(shown):
        cells = {
            r["task"]: r
            for r in per_task
            if r["method"] == method and (method == "full" or float(r["budget"]) == chosen)
        }
        present = [t for t in tasks if t in cells]
        items = [cells[t] for t in present]
        xs = [tasks.index(t) + (j - (len(shown) - 1) / 2) * width for t in present]
        ax.bar(xs, [r["score"] for r in items], width, label=method, color=method_style(method)["color"])
        ax.errorbar(xs, [r["score"] for r in items], yerr=_whiskers(items, "score"), fmt="none", ecolor="0.3", lw=0.8)
    ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(tasks) - 0.4)
    ax.set_ylim(0.0, 102.0)
    ax.set_ylabel(f"score at budget {chosen:g} (%, 95% CI)")
    ax.set_title(wrapped(title, 90), fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    legend_outside(ax)
    fig.tight_layout()
    return fig
