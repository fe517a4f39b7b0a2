"""The performance study behind docs/results/performance.md, in one process.

Five grids into one folder (records.jsonl accumulates; an interrupted run resumes):

1. every context length (1K-8K) at budget 0.2, batch 1: full cache, our methods, kvpress's;
2. 4K at budgets 0.1 and 0.4, batch 1 (the budget axis);
3. 4K at budget 0.2 with batch 4 (throughput against batch 1 of grid 1);
4. 4K at budget 0.2, the other budget allocators (layer-varying, head-prior, cross-layer): memory
   and selection time for every kind of method;
5. into ``OUT/exact-norms``: the Critical variants at 4K and 8K with float32 value norms
   (``precision="exact"``) instead of the default ``auto`` (bfloat16 on CPUs with AVX512-BF16).

Run it in an environment with kvpress (``pip install -e '.[bench]'``, which pins transformers
5.2.x), e.g. ``python benchmarks/performance.py --out docs/results/performance``; without kvpress
it measures criticalkv alone. Add ``--quick`` for a small smoke run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from criticalkv.bench import BenchConfig, run_bench
from criticalkv.bench.figure import plot
from criticalkv.bench.kvpress_impl import import_kvpress
from criticalkv.bench.runner import load_records
from criticalkv.bench.tables import format_table
from criticalkv.methods import available_methods
from criticalkv.models import load_model

METHODS = ["snapkv", "critical-snapkv", "adakv", "critical-adakv"]
_OTHERS = ("pyramidkv", "headkv", "critical-headkv", "defensivekv", "layer-defensivekv")
OTHER_METHODS = [m for m in _OTHERS if m in available_methods()]


def grids(quick: bool) -> list[BenchConfig]:
    if quick:
        return [BenchConfig(context_lengths=[256], methods=METHODS, budgets=[0.2], decode_tokens=4, window=16)]
    return [
        BenchConfig(context_lengths=[1024, 2048, 4096, 8128], methods=METHODS, budgets=[0.2], decode_tokens=32),
        BenchConfig(context_lengths=[4096], methods=METHODS, budgets=[0.1, 0.4], decode_tokens=32),
        BenchConfig(
            context_lengths=[4096],
            methods=["snapkv", "critical-adakv"],
            budgets=[0.2],
            batch_sizes=[4],
            decode_tokens=32,
            kvpress="off",
        ),
        BenchConfig(context_lengths=[4096], methods=OTHER_METHODS, budgets=[0.2], decode_tokens=32, kvpress="off"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    kvpress_model = load_model(args.model)[0] if import_kvpress() is not None else None
    for config in grids(args.quick):
        if kvpress_model is None:
            config.kvpress = "off"
        run_bench(config, model, tokenizer, kvpress_model=kvpress_model, out=args.out)
    if not args.quick:
        exact = BenchConfig(
            context_lengths=[4096, 8128],
            methods=["critical-snapkv", "critical-adakv"],
            budgets=[0.2],
            decode_tokens=8,
            kvpress="off",
            norm_precision="exact",
        )
        run_bench(exact, model, tokenizer, out=args.out / "exact-norms")
    records = load_records(args.out / "records.jsonl")
    (args.out / "results.json").write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    title = f"criticalkv bench: {args.model} model, {torch.get_num_threads()} threads, torch {torch.__version__}"
    table = format_table(records)
    (args.out / "table.txt").write_text(title + "\n" + table + "\n", encoding="utf-8")
    plot(records, args.out / "bench.png", title)
    print(title)
    print(table)


if __name__ == "__main__":
    main()
