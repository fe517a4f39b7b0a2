"""Issue 42, points 1-3: figures that show who wins and by how much, checked on the rendered
figure's artists and axes (matplotlib objects), not on pixels."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from matplotlib.container import ErrorbarContainer

from criticalkv.analysis.aggregate import aggregate
from criticalkv.analysis.plots import curves_figure
from criticalkv.analysis.results_log import ResultsLog
from criticalkv.eval.demo import DEMO_METHODS
from criticalkv.eval.demo import figure as demo_figure
from criticalkv.eval.report import AVERAGE, budget_figure, tasks_figure
from criticalkv.methods.registry import method_colour
from criticalkv.plotting import pyplot

ROOT = Path(__file__).resolve().parents[2]
LONG = "ruler, default, 1024 tokens, question-aware, n = 140 per point, a title long enough to need a second line"


def _row(method: str, budget: float, task: str, score: float, nll: float) -> dict[str, Any]:
    return {
        "length": "all", "method": method, "budget": budget, "task": task, "n": 10,
        "score": score, "score_ci_low": score - 20, "score_ci_high": score + 20,
        "nll_increase": nll, "nll_increase_ci_low": nll - 0.1, "nll_increase_ci_high": nll + 0.2,
    }  # fmt: skip


def _rows(budgets: tuple[float, ...] = (0.2,)) -> list[dict[str, Any]]:
    rows = [_row("full", 1.0, t, 60.0, 0.0) for t in ("a", "b", AVERAGE)]
    for b in budgets:  # snapkv and adakv coincide: both must stay visible
        rows += [_row(m, b, t, 50.0, 0.455) for m in ("snapkv", "adakv") for t in ("a", "b", AVERAGE)]
        rows += [_row("critical-snapkv", b, t, 60.0, 0.593) for t in ("a", "b", AVERAGE)]
    return rows


def _outside(fig: Any, ax: Any, legend: Any) -> bool:
    """Whether ``legend`` lies beside ``ax``'s plot area, covering none of it."""
    fig.canvas.draw()
    box, area = legend.get_window_extent(), ax.get_window_extent()
    return box.x0 >= area.x1 or box.x1 <= area.x0 or box.y0 >= area.y1 or box.y1 <= area.y0


def _inside_figure(fig: Any, artist: Any) -> bool:
    fig.canvas.draw()
    box, page = artist.get_window_extent(), fig.bbox
    return box.x0 >= page.x0 - 1 and box.x1 <= page.x1 + 1


@pytest.mark.parametrize("key", ["score", "nll_increase"])
def test_budget_figures_draw_intervals_from_zero_with_one_tick_per_budget(key: str) -> None:
    fig = budget_figure(_rows(), key, LONG)
    try:
        (ax,) = fig.axes
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(bars) == 3  # every method has its interval drawn
        (snap,) = [c for c in bars if c.get_label() == "snapkv"]
        segment = snap.lines[2][0].get_segments()[0]
        low, high = sorted(y for _, y in segment)
        want = (30.0, 70.0) if key == "score" else (0.355, 0.655)
        assert (low, high) == pytest.approx(want)
        assert ax.get_ylim()[0] <= 0.0  # no axis that starts near the data and magnifies noise
        if key == "score":
            assert ax.get_ylim()[1] >= 100.0
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0.2"]  # one budget, one tick
        xs = {c.get_label(): c.lines[0].get_xdata()[0] for c in bars}
        assert xs["snapkv"] != xs["adakv"]  # coinciding values side by side
        legend = ax.get_legend()
        assert any(t.get_text().startswith("full cache") for t in legend.get_texts())
        assert _outside(fig, ax, legend)
        assert "\n" in ax.get_title() and _inside_figure(fig, ax.title)
    finally:
        pyplot().close(fig)


def test_several_budgets_are_evenly_spaced_ticks() -> None:
    fig = budget_figure(_rows((0.1, 0.2, 0.4)), "score", "t")
    try:
        (ax,) = fig.axes
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0.1", "0.2", "0.4"]
        assert list(ax.get_xticks()) == [0, 1, 2]
    finally:
        pyplot().close(fig)


def test_tasks_figure_has_intervals_and_a_legend_beside_the_bars() -> None:
    fig = tasks_figure(_rows(), 0.2, LONG)
    try:
        (ax,) = fig.axes
        assert len(ax.patches) == 4 * 2  # full + 3 methods, 2 tasks
        whiskers = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(whiskers) == 4
        assert ax.get_ylim() == (0.0, 102.0)
        assert _outside(fig, ax, ax.get_legend())
    finally:
        pyplot().close(fig)


def _demo_table() -> list[dict[str, Any]]:
    same = {"adakv": 0.5, "layer-defensivekv": 0.5, "critical-adakv": 0.25, "defensivekv": 0.25}
    table = [{"method": "full", "budget": 1.0, "accuracy": 1.0, "kv_mb": 92.0}]
    for m in DEMO_METHODS:
        if m != "full":
            acc = 1.0 if m == "critical-snapkv" else same.get(m, 0.75)
            table += [{"method": m, "budget": b, "accuracy": acc, "kv_mb": 92.0 * b} for b in (0.1, 0.2)]
    return table


def test_demo_lines_that_coincide_stay_visible_and_the_star_is_in_the_legend() -> None:
    fig = demo_figure(_demo_table(), "needle retrieval, 4 samples")
    try:
        left, right = fig.axes
        lines = {line.get_label(): line for line in left.get_lines()}
        for a, b in (("adakv", "layer-defensivekv"), ("critical-adakv", "defensivekv")):
            assert list(lines[a].get_ydata()) == list(lines[b].get_ydata())
            assert list(lines[a].get_xdata()) != list(lines[b].get_xdata())
        full = lines["full cache"]
        assert list(lines["critical-snapkv"].get_xdata()) != list(full.get_xdata())  # not under the full line
        (legend,) = fig.legends
        texts = [t.get_text() for t in legend.get_texts()]
        assert "full cache (memory)" in texts and set(DEMO_METHODS) - {"full"} <= set(texts)
        star = legend.legend_handles[texts.index("full cache (memory)")]
        assert star.get_marker() == "*"
        assert [t.get_text() for t in left.get_xticklabels()] == ["0.1", "0.2"]
        right_xs = {line.get_color(): line.get_xdata()[0] for line in right.get_lines()[1:]}
        assert len(set(right_xs.values())) == len(right_xs)  # equal memory, side by side
    finally:
        pyplot().close(fig)


def test_perturbation_curves_use_the_shared_palette_and_cut_no_title() -> None:
    rows = ResultsLog(ROOT / "docs/results/perturbation-default/run/results.jsonl").rows()
    groups, pairs = aggregate(rows)
    fig = curves_figure(groups, pairs, "perturbation vs budget, default model, 12 samples")
    try:
        first = fig.axes[0]
        colours = {line.get_label(): line.get_color() for line in first.get_lines()}
        for method in ("snapkv", "critical-snapkv", "adakv", "critical-adakv"):
            assert colours[method] == method_colour(method)
        titles = [ax.title for ax in fig.axes if ax.get_title()]
        assert all(_inside_figure(fig, t) for t in titles)
        for row in (fig.axes[:3], fig.axes[3:]):  # neighbouring titles do not run into each other
            boxes = sorted((ax.title.get_window_extent() for ax in row), key=lambda b: b.x0)
            assert all(a.x1 <= b.x0 for a, b in itertools.pairwise(boxes))
    finally:
        pyplot().close(fig)
