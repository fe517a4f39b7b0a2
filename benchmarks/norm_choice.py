"""Gram-form L2 against exact L1 value norms, paired per sample on one RULER sweep (issue 31, part 4).

Reads one or more ``results.jsonl`` files of ``criticalkv eval`` runs that hold both a ``critical-X``
method and its ``critical-X:gram=true:p=2`` variant on the same prompts, and prints a Markdown table
of variant minus L1 per (method, budget): the task score in points and the gold answer's NLL in
nats/token, each with its paired 95% bootstrap interval (stratified by task, as the report's).

    python benchmarks/norm_choice.py docs/results/ruler-default/aware-20/results.jsonl \
        docs/results/gram-norms/ruler-aware-20-l2gram.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from criticalkv.eval.report import by_config, paired_difference

VARIANT = ":gram=true:p=2"


def records(paths: list[Path]) -> list[dict[str, Any]]:
    """Every complete line of the files, in order."""
    out = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """One Markdown row per (L1 method, budget) whose Gram variant ran on shared samples."""
    configs = by_config(rows)
    lines = [
        "| method | budget | n | L1 score | L2-Gram score | score diff [95% CI] | NLL diff [95% CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    for (method, budget), mine in sorted(configs.items(), key=lambda kv: (kv[0][0], float(kv[0][1]))):
        if not method.endswith(VARIANT):
            continue
        base_name = method.removesuffix(VARIANT)
        base = configs.get((base_name, budget))
        diff = paired_difference(mine, base) if base else None
        if diff is None or base is None:
            continue
        shared = set(mine) & set(base)
        l1 = 100 * sum(base[k]["score"] for k in shared) / len(shared)
        l2 = 100 * sum(mine[k]["score"] for k in shared) / len(shared)
        lines.append(
            f"| {base_name} | {budget} | {int(diff['n'])} | {l1:.1f} | {l2:.1f} "
            f"| {diff['score_diff']:+.1f} [{diff['score_diff_low']:+.1f}, {diff['score_diff_high']:+.1f}] "
            f"| {diff['nll_diff']:+.3f} [{diff['nll_diff_low']:+.3f}, {diff['nll_diff_high']:+.3f}] |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.jsonl files (concatenated)")
    print(table(records(parser.parse_args().results)))


if __name__ == "__main__":
    main()
