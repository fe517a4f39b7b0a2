"""``heads.csv``, ``summary.md`` and the plots, regenerated from ``results.jsonl``."""

from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from criticalkv.analysis.aggregate import HEAD_MEASURES, QUERY_SETS, GroupStats, PairStats, aggregate
from criticalkv.analysis.plots import plot_curves, plot_heatmaps
from criticalkv.analysis.results_log import RESULTS_FILE, ResultsLog, read_run_config

logger = logging.getLogger(__name__)

HEADS_FILE = "heads.csv"
SUMMARY_FILE = "summary.md"
CURVES_FILE = "curves.png"
HEATMAP_FILES = {q: f"heatmap-{q}.png" for q in QUERY_SETS}


@dataclass(frozen=True)
class Report:
    """What :func:`write_report` wrote, and the aggregates behind it."""

    heads: Path
    summary: Path
    plots: list[Path]
    groups: list[GroupStats]
    pairs: list[PairStats]
    text: str


def _fmt(value: float, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}g}"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}%"


def write_heads_csv(groups: Sequence[GroupStats], pairs: Sequence[PairStats], path: Path) -> Path:
    """One row per (layer, query head, method, budget): sample means and the reduction vs base."""
    reductions = {(p.variant.method, str(p.budget)): p.reduction for p in pairs}
    fields = ["layer", "head", "kv_head", "method", "base", "budget", "samples", *HEAD_MEASURES]
    fields += [f"reduction_{q}" for q in QUERY_SETS]
    staging = path.with_suffix(".csv.tmp")
    with staging.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(fields)
        for g in groups:
            layers, heads = g.shape
            kv_heads = next(iter(g.kept.values())).shape[-1]
            group_size = max(1, heads // max(1, kv_heads))
            red = reductions.get((g.method, str(g.budget)))
            for layer in range(layers):
                for head in range(heads):
                    row: list[Any] = [layer, head, head // group_size, g.method, g.base or "", g.budget, len(g.samples)]
                    row += [f"{float(g.heads[m][layer, head]):.6g}" for m in HEAD_MEASURES]
                    for q in QUERY_SETS:
                        value = float(red[q][layer, head]) if red is not None else math.nan
                        row.append("" if math.isnan(value) else f"{value:.6g}")
                    writer.writerow(row)
    os.replace(staging, path)
    return path


def _weak_layers(layer_improved: np.ndarray) -> str:
    weak = [str(i) for i, share in enumerate(layer_improved) if share < 0.5]
    return ", ".join(weak) if weak else "none"


def _intro_lines(groups: Sequence[GroupStats], config: dict[str, Any], command: str | None) -> list[str]:
    """The title, the measurement's description and the command."""
    spec = config.get("spec", {})
    samples = sorted({s for g in groups for s in g.samples})
    layers, heads = groups[0].shape if groups else (0, 0)
    lines = [
        f"# Per-head output perturbation: {spec.get('model', '?')} model",
        "",
        f"{len(samples)} needle samples (RULER niah_single shape) of {spec.get('length', '?')} context tokens, "
        f"question-aware prompt, observation window {spec.get('window', '?')}, seed {spec.get('seed', '?')}; "
        f"{layers} layers x {heads} query heads = {layers * heads} heads. Window queries: the last "
        f"{spec.get('window', '?')} prompt queries (causal); decode queries: the teacher-forced gold answer "
        "tokens, attention over the prompt keys. `L = ||o - o_hat||_1` with `o = A V W_O^h`.",
        "",
    ]
    if command:
        lines += ["Command:", "", "```bash", command, "```", ""]
    return lines


def _reduction_lines(pairs: Sequence[PairStats]) -> list[str]:
    """The table of heads whose perturbation each Critical variant lowers."""
    lines = [
        "## Heads whose perturbation the Critical variant lowers",
        "",
        "Share of heads whose sample-mean `L` is lower with the Critical variant (and of (sample, head) "
        "pairs); mean and median over heads of the per-head relative reduction `1 - L_critical / L_base` "
        "(positive: the Critical variant perturbs less); reduction of the summed `L` over all heads.",
        "",
        "| base | budget | queries | heads lowered | (sample, head) lowered | mean rel. reduction "
        "| median rel. reduction | reduction of summed L | layers with < 50% lowered |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        for q in QUERY_SETS:
            cells = [p.base.method, str(p.budget), q, _pct(p.improved[q]), _pct(p.improved_per_sample[q])]
            cells += [_pct(p.mean_reduction[q]), _pct(p.median_reduction[q]), _pct(p.overall_reduction[q])]
            cells.append(_weak_layers(p.layer_improved[q]))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _perturbation_lines(groups: Sequence[GroupStats]) -> list[str]:
    """The table of mean perturbation and bound per (method, budget)."""
    lines = [
        "",
        "## Mean perturbation and bound (over heads and samples)",
        "",
        "| method | budget | L window | L decode | sigma window | sigma decode | theta window | theta decode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        h = {m: float(g.heads[m].mean()) for m in HEAD_MEASURES}
        lines.append(
            f"| {g.method} | {g.budget} | {_fmt(h['perturbation_window'])} | {_fmt(h['perturbation_decode'])} "
            f"| {_fmt(h['sigma_window'])} | {_fmt(h['sigma_decode'])} | {_fmt(h['theta_window'])} "
            f"| {_fmt(h['theta_decode'])} |"
        )
    return lines


def _drift_lines(groups: Sequence[GroupStats], pairs: Sequence[PairStats]) -> list[str]:
    """The table of final-layer hidden-state drift, each Critical variant against its base."""
    drift_base = {(p.variant.method, str(p.budget)): p.base.drift for p in pairs}
    lines = [
        "",
        "## Final-layer hidden-state drift over the answer tokens (compressed vs full cache)",
        "",
        "| method | budget | L1 | relative L1 | cosine similarity | L1 vs base |",
        "|---|---|---|---|---|---|",
    ]
    for g in groups:
        base = drift_base.get((g.method, str(g.budget)))
        versus = "-" if base is None or base["hidden_l1"] <= 0 else _pct(g.drift["hidden_l1"] / base["hidden_l1"] - 1)
        lines.append(
            f"| {g.method} | {g.budget} | {_fmt(g.drift['hidden_l1'])} | {_fmt(g.drift['hidden_l1_relative'])} "
            f"| {g.drift['hidden_cosine']:.6f} | {versus} |"
        )
    return lines


def _check_lines(groups: Sequence[GroupStats], pairs: Sequence[PairStats]) -> list[str]:
    """The checks: the bound held, `sigma > 1/2` shares, per-head budgets equal to the base's."""
    measured = sum(g.counts["measured"] for g in groups)
    violations = sum(g.counts["bound_violations"] for g in groups)
    above_half = sum(g.counts["sigma_above_half"] for g in groups)
    mismatched = [f"{p.base.method} @ {p.budget}" for p in pairs if not p.budgets_match]
    lines = [
        "",
        "## Checks",
        "",
        f"- The bound `L <= theta` held for {measured - violations} of {measured} measured (sample, method, "
        f"budget, layer, head, query) cases; `sigma > 1/2` in {_pct(above_half / measured if measured else math.nan)} "
        "of them.",
        "- Per-head budgets of each Critical variant equal its base's on every sample: "
        + ("yes." if not mismatched else f"NO for {', '.join(mismatched)}."),
    ]
    for g in groups:
        if g.counts["measured"]:
            share = g.counts["sigma_above_half"] / g.counts["measured"]
            lines.append(f"  - `sigma > 1/2`: {g.method} @ {g.budget}: {_pct(share)}")
    return lines


def summary_text(
    groups: Sequence[GroupStats], pairs: Sequence[PairStats], config: dict[str, Any], command: str | None
) -> str:
    """The Markdown summary: fractions of heads improved, reductions, drift, checks, command."""
    lines = _intro_lines(groups, config, command)
    lines += _reduction_lines(pairs)
    lines += _perturbation_lines(groups)
    lines += _drift_lines(groups, pairs)
    lines += _check_lines(groups, pairs)
    provenance = config.get("provenance", {})
    if provenance:
        lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in provenance.items() if v) + "."]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, command: str | None = None) -> Report:
    """Regenerate ``heads.csv``, ``summary.md`` and the plots from ``out_dir/results.jsonl``.

    Parameters
    ----------
    out_dir : the run folder.
    command : the command line to quote; default: the last one recorded in ``config.json``.

    Raises
    ------
    ValueError
        If the folder holds no results.
    """
    out_dir = Path(out_dir)
    rows = ResultsLog(out_dir / RESULTS_FILE).rows()
    if not rows:
        raise ValueError(f"{out_dir / RESULTS_FILE} holds no results; run the measurement first")
    config = read_run_config(out_dir)
    if command is None and config.get("commands"):
        command = str(config["commands"][-1])
    groups, pairs = aggregate(rows)
    heads = write_heads_csv(groups, pairs, out_dir / HEADS_FILE)
    text = summary_text(groups, pairs, config, command)
    plots: list[Path] = []
    model = config.get("spec", {}).get("model", "?")
    n = len({s for g in groups for s in g.samples})
    if pairs:
        for q, name in HEATMAP_FILES.items():
            title = f"{q} queries: relative reduction of per-head perturbation, {model} model, {n} samples"
            plots.append(plot_heatmaps(pairs, out_dir / name, q, title))
    plots.append(
        plot_curves(groups, pairs, out_dir / CURVES_FILE, f"perturbation vs budget, {model} model, {n} samples")
    )
    text += "\nPlots: " + ", ".join(f"[{p.name}]({p.name})" for p in plots) + "\n"
    summary = out_dir / SUMMARY_FILE
    staging = summary.with_suffix(".md.tmp")
    staging.write_text(text)
    os.replace(staging, summary)
    return Report(heads=heads, summary=summary, plots=plots, groups=groups, pairs=pairs, text=text)
