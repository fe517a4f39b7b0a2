"""The bench's figure, ``bench.png``: decode ms/token per method, and compression time as a share of the
prefill; and the decode scripts' figure of each step against the generated position (:func:`plot_steps`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from criticalkv.bench.tables import COMPRESS_SHARE, CRITICAL_EXTRA, derived, method_label
from criticalkv.plotting import method_style, pyplot
from criticalkv.runs import write_atomically


def _label(impl: str, method: str) -> str:
    return method if impl == "criticalkv" else f"{method} (kvpress)"


def _decode_panel(ax: Any, rows: list[dict[str, Any]], shown: float) -> None:
    """Decode ms/token against context length per (impl, method); bars per method when there is one length."""
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    slowest: dict[tuple[str, str, int], float] = {}  # the slowest round: the bar's or point's whisker
    for r in rows:
        if r["method"] == "full" or r["budget"] == shown:
            series.setdefault((r["impl"], method_label(r)), []).append((r["context_tokens"], r["decode_ms_per_token"]))
            slowest[(r["impl"], method_label(r), r["context_tokens"])] = max(
                r.get("decode_ms_rounds") or [r["decode_ms_per_token"]]
            )
    lengths = sorted({n for points in series.values() for n, _ in points})
    names = sorted(series)
    if len(lengths) == 1:  # one context length: a bar per method, not a column of dots
        for i, (impl, method) in enumerate(names):
            style = method_style(method)
            best = series[(impl, method)][0][1]
            ax.bar(i, best, color=style["color"], hatch="//" if impl == "kvpress" else None)
            ax.errorbar(i, best, yerr=[[0.0], [slowest[(impl, method, lengths[0])] - best]], color="black", capsize=3)
        ax.set_xticks(range(len(names)), [_label(*n) for n in names], rotation=30, ha="right", fontsize=7)
        ax.set_xlabel(f"method ({lengths[0]} context tokens)")
    else:
        for impl, method in names:
            points = sorted(series[(impl, method)])
            style = method_style(method)
            if impl == "kvpress":
                style = {**style, "linestyle": (0, (1, 1))}
            ax.plot([p[0] for p in points], [p[1] for p in points], label=_label(impl, method), **style)
            whiskers = [slowest[(impl, method, n)] - ms for n, ms in points]
            ax.errorbar(
                [p[0] for p in points],
                [p[1] for p in points],
                yerr=[[0.0] * len(points), whiskers],
                fmt="none",
                ecolor=style["color"],
                capsize=3,
            )
        ax.set_xlabel("context tokens")
        ax.legend(fontsize=7)
    ax.set_ylabel("decode ms / token (fastest round; whisker: slowest)")
    ax.set_title(f"decode latency (budget {shown:g}; full = no eviction)")
    ax.grid(alpha=0.3)


def _share_panel(ax: Any, rows: list[dict[str, Any]], shown: float) -> None:
    """Compression time as a share of the prefill, grouped by context length."""
    bars = [r for r in rows if r["method"] != "full" and r["budget"] == shown]
    lengths = sorted({r["context_tokens"] for r in bars})
    names = sorted({(r["impl"], method_label(r)) for r in bars})
    width = 0.8 / max(len(names), 1)
    for i, (impl, method) in enumerate(names):
        values = []
        for n in lengths:
            match = [r for r in bars if (r["impl"], method_label(r), r["context_tokens"]) == (impl, method, n)]
            values.append(100 * match[0]["compress_s"] / match[0]["prefill_s"] if match else 0.0)
        xs = [j + i * width for j in range(len(lengths))]
        colour = method_style(method)["color"]
        ax.bar(xs, values, width, label=_label(impl, method), color=colour, hatch="//" if impl == "kvpress" else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [str(n) for n in lengths])
    ax.set_xlabel("context tokens")
    ax.set_ylabel("compress s / prefill s, %")
    ax.set_title("compression time, % of the prefill (compress s / prefill s)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def plot(records: Sequence[dict[str, Any]], path: Path, title: str, caveats: Sequence[str] = ()) -> Path:
    """Decode ms/token per (impl, method) at batch 1 and the first budget (against context length,
    or bars where there is one), and bars of compression time as a share of the prefill; under the
    panels, the definitions the table uses and ``caveats`` (see :func:`~criticalkv.bench.tables.caveats`)."""
    plt = pyplot()
    rows = [r for r in derived(records) if r["batch_size"] == min(x["batch_size"] for x in records)]
    budgets = sorted({r["budget"] for r in rows if r["method"] != "full"})
    shown = 0.2 if 0.2 in budgets else (budgets[0] if budgets else 1.0)
    footer = [COMPRESS_SHARE, CRITICAL_EXTRA, *caveats]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.0 + 0.25 * len(footer)))
    _decode_panel(left, rows, shown)
    _share_panel(right, rows, shown)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05 * len(footer), 1, 1))
    fig.text(0.01, 0.01, "\n".join(footer), fontsize=7, va="bottom", wrap=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_atomically(path, functools.partial(fig.savefig, dpi=120))
    finally:
        plt.close(fig)
    return path


def plot_steps(
    steps: list[dict[str, Any]],
    names: list[str],
    path: Path,
    *,
    smooth: int,
    bytes_key: str,
    bytes_label: str = "KV cache MiB",
    linewidth: float | None = None,
) -> None:
    """ms/token (rolling median) and KV MiB (``<name>/<bytes_key>``) against the generated position."""
    import torch

    plt = pyplot()
    fig, (ax_ms, ax_mb) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        ms = torch.tensor([r[f"{name}/ms"] for r in steps])
        rolled = ms.unfold(0, smooth, 1).median(-1).values if len(ms) >= smooth else ms
        ax_ms.plot(range(len(rolled)), rolled.tolist(), label=name, linewidth=linewidth)
        ax_mb.plot([r["position"] for r in steps], [r[f"{name}/{bytes_key}"] / 2**20 for r in steps], label=name)
    ax_ms.set(xlabel="generated position", ylabel=f"decode ms/token (rolling median of {smooth})")
    ax_mb.set(xlabel="generated position", ylabel=bytes_label)
    ax_ms.legend()
    ax_mb.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
