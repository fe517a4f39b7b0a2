"""Markdown tables of benchmarks/gram_prefill.py's raw outputs (docs/results/gram-norms.md).

python benchmarks/gram_report.py docs/results/gram-norms
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def overhead_table(rows: list[dict[str, Any]]) -> str:
    """One line per (length, base, variant): the base's TTFT and selection, the variant's selection,
    its extra time (best of each, and the median of the per-round paired differences) over the TTFT."""
    lines = [
        "| T | base | variant | base TTFT (s) | base selection (s) | variant selection (s) | Gram norms alone (s) "
        "| extra / base TTFT (best-of) | extra / base TTFT (paired median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["length"], r["base"], r["variant"])):
        norms = r["variant_norms_s"]
        cells = [
            r["length"],
            r["base"],
            r["variant"],
            f"{r['base_ttft_s']:.2f}",
            f"{r['base_select_s']:.3f}",
            f"{r['variant_select_s']:.3f}",
            "-" if norms != norms else f"{norms:.3f}",  # NaN: not timed for L1
            f"{r['extra_share_of_base_ttft']:+.2%}",
            f"{r['extra_paired_median_s'] / r['base_ttft_s']:+.2%}",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def overlap_summary(rows: list[dict[str, Any]]) -> str:
    """Per (length, base): prompts, then mean / min over every (prompt, layer, head) and the lowest
    per-layer mean, for the kept-set overlap, the Jaccard index and the stage-2 overlap."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["length"], r["base"])].append(r)
    lines = [
        "| T | base | prompts | overlap mean | min | lowest layer mean | Jaccard mean | min | lowest layer mean "
        "| stage-2 overlap mean | min | lowest layer mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (length, base), mine in sorted(groups.items()):
        cells: list[Any] = [length, base, len({r["task"] for r in mine})]
        for field in ("overlap", "jaccard", "stage2_overlap"):
            per_layer: dict[int, list[float]] = defaultdict(list)
            for r in mine:
                per_layer[r["layer"]].extend(r[field])
            means = {layer: statistics.fmean(v) for layer, v in per_layer.items()}
            worst = min(means, key=lambda layer: means[layer])
            every = [v for values in per_layer.values() for v in values]
            cells += [f"{statistics.fmean(every):.4f}", f"{min(every):.4f}", f"{means[worst]:.4f} (layer {worst})"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    folder = parser.parse_args().folder
    for name in ("overhead.jsonl", "overhead-cpu.jsonl"):
        rows = _rows(folder / name)
        if rows:
            print(f"{name} ({rows[0].get('clock', 'wall')} clock)\n\n{overhead_table(rows)}\n")
    rows = _rows(folder / "overlap.jsonl")
    if rows:
        print(f"overlap.jsonl\n\n{overlap_summary(rows)}")


if __name__ == "__main__":
    main()
