"""The quality columns of docs/methods.md's "Which method to pick": per method and budget, the
RULER average score and the gold answer's NLL increase over the full cache, each with its 95%
interval, read from the ``summary.csv`` of ``criticalkv eval`` folders (one per prompt mode).

    python benchmarks/method_guide.py docs/results/ruler-default/aware-20 docs/results/ruler-default/agnostic-20
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

ORDER = ["full", "snapkv", "critical-snapkv", "adakv", "critical-adakv", "defensivekv", "layer-defensivekv"]


def averages(folder: Path) -> dict[tuple[str, str], dict[str, str]]:
    """``{(method, budget): row}`` of the folder's average rows over all lengths."""
    with (folder / "summary.csv").open(encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["task"] == "average" and r["length"] == "all"]
    return {(r["method"], r["budget"]): r for r in rows}


def cell(row: dict[str, str] | None) -> str:
    """``score [low, high] / dNLL [low, high]`` of one average row."""
    if row is None:
        return "-"
    score = f"{float(row['score']):.1f} [{float(row['score_ci_low']):.1f}, {float(row['score_ci_high']):.1f}]"
    if row["method"] == "full":
        return score
    nll = (
        f"{float(row['nll_increase']):.2f} [{float(row['nll_increase_ci_low']):.2f}, "
        f"{float(row['nll_increase_ci_high']):.2f}]"
    )
    return f"{score} / {nll}"


def table(folders: list[Path]) -> str:
    """One Markdown row per (method, budget); one column per folder."""
    tables = [averages(f) for f in folders]
    budgets = sorted({b for t in tables for (_, b) in t if b != "1.0"}, key=float)
    head = "| method | budget | " + " | ".join(f"{f.name}: score [95% CI] / dNLL [95% CI]" for f in folders) + " |"
    lines = [head, "|---|---|" + "---|" * len(folders)]
    lines.append("| full | 1.0 | " + " | ".join(cell(t.get(("full", "1.0"))) for t in tables) + " |")
    for budget in budgets:
        for method in ORDER[1:]:
            lines.append(f"| {method} | {budget} | " + " | ".join(cell(t.get((method, budget))) for t in tables) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="criticalkv eval folders (with summary.csv)")
    print(table(parser.parse_args().folders))


if __name__ == "__main__":
    main()
