"""One colour per method in every figure, markers and line styles that keep coinciding lines
visible, and sweep figures titled with what they show (issue 29, point 7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from criticalkv.eval.demo import DEMO_METHODS
from criticalkv.eval.demo import plot as demo_plot
from criticalkv.eval.report import AVERAGE, plot_title
from criticalkv.eval.report import plot as report_plot
from criticalkv.methods import Method, available_methods, method_colour, register
from criticalkv.plotting import method_style


def test_every_method_has_one_colour_and_its_own_marker_and_line() -> None:
    colours = [method_colour(m) for m in available_methods()]
    assert all(colours) and len(set(colours)) == len(colours)  # each registered with a colour of its own
    assert all(method_style(m)["color"] == method_colour(m) for m in available_methods())
    styles = [method_style(m) for m in DEMO_METHODS]
    assert len({s["color"] for s in styles}) == len(DEMO_METHODS)
    assert len({(s["marker"], s["linestyle"]) for s in styles}) == len(DEMO_METHODS)
    assert method_style("snapkv+q4")["color"] == method_style("snapkv")["color"] == method_colour("snapkv")
    assert method_style("my-method") == method_style("my-method")  # stable for unknown names too


def test_a_colour_that_is_no_colour_is_refused_before_the_method_is_registered() -> None:
    with pytest.raises(ValueError, match="a method's colour is a matplotlib colour such as '#08519c', not ''"):
        register(Method("no-colour", "-", "-", None), colour="")
    assert "no-colour" not in available_methods()
    assert method_colour("no-colour") is None and method_style("no-colour")["color"].startswith("#")


def _rows() -> list[dict]:
    rows = []
    for method, budget, score in [("full", 1.0, 0.8), ("snapkv", 0.2, 0.5), ("critical-snapkv", 0.2, 0.5)]:
        for length in ("1024", "all"):
            for task in ("niah_single_1", AVERAGE):
                row = {"method": method, "budget": budget, "length": length, "task": task, "n": 3}
                rows.append({**row, "score": score, "nll_increase": 0.1})
    return rows


def test_sweep_figures_say_length_mode_and_n(tmp_path: Path) -> None:
    identity = {"benchmark": "ruler", "model": "default", "mode": "question-aware"}
    (tmp_path / "run.json").write_text(json.dumps({"identity": identity, "runs": []}))
    title = plot_title(tmp_path, _rows())
    assert title == "ruler, default, 1024 tokens, question-aware, n = 3 per point"
    paths = report_plot(_rows(), tmp_path, title=title)
    assert [p.name for p in paths] == ["score_vs_budget.png", "nll_vs_budget.png", "tasks_at_budget.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_the_demo_plot_shows_score_beside_memory(tmp_path: Path) -> None:
    table = [
        {"method": m, "budget": b, "accuracy": 0.5, "kv_mb": 10 * b}
        for m in DEMO_METHODS
        for b in ((1.0,) if m == "full" else (0.1, 0.2))
    ]
    demo_plot(table, tmp_path / "demo.png", "needle retrieval, 1 sample")
    assert (tmp_path / "demo.png").stat().st_size > 1000
