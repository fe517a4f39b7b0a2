"""Check a performance run (``results.json`` of benchmarks/performance.py) against the targets.

Targets (default model, CPU): the Critical variant's extra selection time over its base is at
most 2% of the prefill at 4K and 8K; every method holds at most budget x full + 2% after
compression; decode at budget 0.2 is at least 1.3x faster than the full cache at 8K and 1.15x at
4K, and at least 1.3x faster than kvpress's AdaKV / CriticalAdaKV at 8K; batch 4 decodes more
tokens per second than batch 1. Prints a markdown table; ``python benchmarks/targets.py DIR``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _find(records: list[dict[str, Any]], **want: Any) -> dict[str, Any] | None:
    for r in records:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def checks(records: list[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(target, measured, met) rows."""
    rows: list[tuple[str, str, bool]] = []
    lengths = sorted({r["context_tokens"] for r in records})
    long, mid = lengths[-1], (4096 if 4096 in lengths else lengths[-1])
    for n in sorted({mid, long}):
        for base in ("snapkv", "adakv"):
            b = _find(records, impl="criticalkv", method=base, context_tokens=n, budget=0.2, batch_size=1)
            c = _find(records, impl="criticalkv", method=f"critical-{base}", context_tokens=n, budget=0.2, batch_size=1)
            if b and c:
                share = (c["compress_s"] - b["compress_s"]) / c["prefill_s"]
                rows.append(
                    (
                        f"critical-{base} selection overhead at {n} <= 2% of prefill",
                        f"{100 * share:.2f}%",
                        share <= 0.02,
                    )
                )
    for r in records:
        if r["impl"] == "criticalkv" and r["method"] != "full" and r["batch_size"] == 1:
            ok = r["kv_bytes"] <= (r["budget"] + 0.02) * r["kv_bytes_full"]
            if not ok or r["context_tokens"] == mid:
                rows.append(
                    (
                        f"{r['method']} at {r['context_tokens']}, budget {r['budget']:g}: KV <= budget + 2%",
                        f"{r['kv_ratio']:.4f}",
                        ok,
                    )
                )
    for n, need in ((mid, 1.15), (long, 1.3)):
        full = _find(records, impl="criticalkv", method="full", context_tokens=n, batch_size=1)
        for m in ("snapkv", "critical-snapkv", "adakv", "critical-adakv"):
            r = _find(records, impl="criticalkv", method=m, context_tokens=n, budget=0.2, batch_size=1)
            if full and r:
                x = full["decode_ms_per_token"] / r["decode_ms_per_token"]
                rows.append((f"{m} decode at {n} >= {need}x full", f"{x:.2f}x", x >= need))
    for m in ("adakv", "critical-adakv"):
        ours = _find(records, impl="criticalkv", method=m, context_tokens=long, budget=0.2, batch_size=1)
        theirs = _find(records, impl="kvpress", method=m, context_tokens=long, budget=0.2, batch_size=1)
        if ours and theirs:
            x = theirs["decode_ms_per_token"] / ours["decode_ms_per_token"]
            rows.append((f"{m} decode at {long} >= 1.3x kvpress's", f"{x:.2f}x", x >= 1.3))
    for r in records:
        if r["impl"] == "criticalkv" and r["batch_size"] > 1:
            one = _find(
                records,
                impl="criticalkv",
                method=r["method"],
                context_tokens=r["context_tokens"],
                budget=r["budget"],
                batch_size=1,
            )
            if one:
                ok = r["tokens_per_s"] > one["tokens_per_s"]
                rows.append(
                    (
                        f"{r['method']} batch {r['batch_size']} tokens/s > batch 1 at {r['context_tokens']}",
                        f"{r['tokens_per_s']:.1f} vs {one['tokens_per_s']:.1f}",
                        ok,
                    )
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    records = json.loads((args.folder / "results.json").read_text())
    print("| target | measured | met |\n|---|---|---|")
    for target, measured, ok in checks(records):
        print(f"| {target} | {measured} | {'yes' if ok else 'no'} |")


if __name__ == "__main__":
    main()
