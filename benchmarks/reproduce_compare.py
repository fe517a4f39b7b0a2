"""Compare a fresh ``make reproduce`` folder with the committed results (the last step of the target).

Reads the claims table of both ``claims.md`` files (``benchmarks/claims.py`` writes them) and prints,
claim by claim, the committed and the fresh measurement and whether the verdict is the same; then
how many claims kept their verdict, which changed, and which are only on one side. Nothing is
rewritten::

    python benchmarks/reproduce_compare.py --fresh reproduce-out --committed docs/results
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

CLAIMS = "claims.md"
#: the claims table's columns (benchmarks/claims.py)
COLUMNS = ("claim", "paper", "measured", "verdict", "n", "command")


def claims_table(path: Path) -> dict[str, dict[str, str]]:
    """``{claim: row}`` of the first claims table in the markdown file ``path``."""
    rows: dict[str, dict[str, str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| ") or line.startswith("| claim |"):
            if rows and not line.startswith("|"):
                break  # the table ended
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == len(COLUMNS):
            rows[cells[0]] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def compare(fresh: dict[str, dict[str, str]], committed: dict[str, dict[str, str]]) -> tuple[str, int]:
    """The comparison's text and how many shared claims changed their verdict."""
    lines, changed = [], 0
    for claim, old in committed.items():
        new = fresh.get(claim)
        if new is None:
            lines.append(f"only committed: {claim}: {old['measured']} ({old['verdict']})")
            continue
        same = new["verdict"] == old["verdict"]
        changed += not same
        mark = "same verdict" if same else f"VERDICT CHANGED: {old['verdict']} -> {new['verdict']}"
        lines.append(f"{claim}\n    committed {old['measured']}\n    fresh     {new['measured']}\n    {mark}")
    lines += [f"only fresh: {claim}: {row['measured']} ({row['verdict']})" for claim, row in fresh.items()
              if claim not in committed]  # fmt: skip
    shared = len(set(fresh) & set(committed))
    lines.append(f"\n{shared - changed} of {shared} shared claims reach the committed verdict; {changed} changed")
    return "\n".join(lines), changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh", type=Path, required=True, help="the folder make reproduce wrote (REPRODUCE_OUT)")
    parser.add_argument("--committed", type=Path, default=Path("docs/results"), help="the committed results")
    args = parser.parse_args(argv)
    if args.fresh.resolve() == args.committed.resolve():
        print(
            "reproduce: the fresh results were written over the committed ones; nothing to compare (git diff shows it)"
        )
        return 0
    missing = [str(p / CLAIMS) for p in (args.fresh, args.committed) if not (p / CLAIMS).is_file()]
    if missing:
        print(f"reproduce_compare: no claims table at {', '.join(missing)}", file=sys.stderr)
        return 2
    text, _ = compare(claims_table(args.fresh / CLAIMS), claims_table(args.committed / CLAIMS))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
