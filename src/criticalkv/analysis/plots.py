"""Figures of the perturbation analysis: layer-by-head heatmaps and curves versus budget."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from criticalkv.analysis.aggregate import GroupStats, PairStats, budget_order
from criticalkv.plotting import method_style, pyplot, wrapped


def plot_heatmaps(pairs: Sequence[PairStats], path: Path, queries: str, title: str) -> Path:
    """A grid (rows: base methods, columns: budgets) of layer x head relative reductions.

    Cell value ``1 - L_critical / L_base`` of the sample-mean perturbation on the ``queries``
    set ("window" or "decode"); blue where the Critical variant lowers it, red where it raises it.
    """
    plt = pyplot()
    bases = list(dict.fromkeys(p.base.method for p in pairs))
    budgets = sorted({str(p.budget): p.budget for p in pairs}.values(), key=budget_order)
    cells = {(p.base.method, str(p.budget)): p for p in pairs}
    layers, heads = pairs[0].base.shape
    fig, axes = plt.subplots(
        len(bases),
        len(budgets),
        figsize=(1.2 + 1.6 * len(budgets), 0.9 + 0.14 * layers * len(bases)),
        squeeze=False,
        sharex=True,
        sharey=True,
    )
    image = None
    for i, base in enumerate(bases):
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            pair = cells.get((base, str(budget)))
            if pair is None:
                ax.set_axis_off()
                continue
            image = ax.imshow(
                np.nan_to_num(pair.reduction[queries], nan=0.0),
                cmap="RdBu",
                vmin=-1.0,
                vmax=1.0,
                aspect="auto",
                interpolation="nearest",
            )
            ax.set_title(f"{base} @ {budget}\n{100 * pair.improved[queries]:.0f}% lowered", fontsize=8)
            if j == 0:
                ax.set_ylabel("layer")
            if i == len(bases) - 1:
                ax.set_xlabel("query head")
            ax.set_xticks(range(0, heads, max(1, heads // 4)))
    if image is not None:
        bar = fig.colorbar(image, ax=axes, shrink=0.8, pad=0.02)
        bar.set_label("1 - L(critical) / L(base), clipped to [-1, 1]")
    fig.suptitle(wrapped(title, max(40, int(fig.get_figwidth() * 11))), fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _budget_axis(ax: Any, budgets: Sequence[Any]) -> None:
    """A log budget axis ticked at the measured budgets, labelled as given."""
    from matplotlib.ticker import NullFormatter, NullLocator

    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks([float(b) for b in budgets], [str(b) for b in budgets])
    ax.set_xlabel("budget")
    ax.grid(True, alpha=0.3)


def _colour(method: str) -> str:
    """The method's colour in every figure (given at its registration: ``method_colour``)."""
    return str(method_style(method)["color"])


def _curve(ax: Any, groups: Sequence[GroupStats], value: Any, ylabel: str) -> None:
    """One line per method in its shared-palette colour (a base light, its Critical variant dark):
    the base dashed, its Critical variant solid."""
    for method in dict.fromkeys(g.method for g in groups):
        members = [g for g in groups if g.method == method]
        pts = sorted(((g.budget, value(g)) for g in members), key=lambda p: budget_order(p[0]))
        style = "--" if members[0].base is None else "-"
        ax.plot([float(p[0]) for p in pts], [p[1] for p in pts], style, color=_colour(method), marker="o", label=method)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    _budget_axis(ax, sorted({str(g.budget): g.budget for g in groups}.values(), key=budget_order))


def plot_curves(groups: Sequence[GroupStats], pairs: Sequence[PairStats], path: Path, title: str) -> Path:
    """Mean perturbation, hidden-state drift and share of heads improved, versus budget (:func:`curves_figure`)."""
    plt = pyplot()
    fig = curves_figure(groups, pairs, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def curves_figure(groups: Sequence[GroupStats], pairs: Sequence[PairStats], title: str) -> Any:
    """The curves' six panels, every method in its colour of the shared palette, no title cut off."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    _curve(axes[0][0], groups, lambda g: float(g.heads["perturbation_window"].mean()), "mean ||o - o_hat||_1, window")
    axes[0][0].set_title("head-output perturbation, window queries", fontsize=9)
    _curve(axes[0][1], groups, lambda g: float(g.heads["perturbation_decode"].mean()), "mean ||o - o_hat||_1, decode")
    axes[0][1].set_title("head-output perturbation, decode queries", fontsize=9)
    _curve(axes[1][0], groups, lambda g: g.drift["hidden_l1_relative"], "||h - h_hat||_1 / ||h||_1")
    axes[1][0].set_title("final hidden state: relative L1 drift", fontsize=9)
    _curve(axes[1][1], groups, lambda g: max(1.0 - g.drift["hidden_cosine"], 1e-12), "1 - cos(h, h_hat)")
    axes[1][1].set_title("final hidden state: cosine distance", fontsize=9)
    for ax, stat, label in (
        (axes[0][2], "improved", "share of heads lowered"),
        (axes[1][2], "median_reduction", "median relative reduction"),
    ):
        bases = list(dict.fromkeys(p.base.method for p in pairs))
        for base in bases:
            pts = sorted((p for p in pairs if p.base.method == base), key=lambda p: budget_order(p.budget))
            for q, style in (("window", "--"), ("decode", "-")):
                ys = [getattr(p, stat)[q] for p in pts]
                xs = [float(p.budget) for p in pts]
                ax.plot(xs, ys, style, color=_colour(f"critical-{base}"), marker="o", label=f"{base}, {q} queries")
        ax.set_ylabel(label)
        _budget_axis(ax, sorted({str(p.budget): p.budget for p in pairs}.values(), key=budget_order))
        if pairs:
            ax.legend(fontsize=7, handlelength=3)
    axes[0][2].axhline(0.5, color="grey", linestyle=":")
    axes[0][2].set_title("Critical variant vs base: heads lowered", fontsize=9)
    axes[1][2].axhline(0.0, color="grey", linestyle=":")
    axes[1][2].set_title(wrapped("Critical vs base: median over heads of 1 - L(critical)/L(base)", 45), fontsize=9)
    axes[0][0].legend(fontsize=7, handlelength=3)
    fig.suptitle(wrapped(title, 150), fontsize=10)
    fig.tight_layout()
    return fig
