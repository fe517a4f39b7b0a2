"""``criticalkv bench``: prefill, compression, TTFT, decode latency and memory, side by side."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from criticalkv.commands.cache_options import FLAGS, add_cache_arguments, spec_from_args
from criticalkv.commands.common import add_model_arguments, budgets_arg, ints_arg, methods_arg, require_extra
from criticalkv.commands.inputs import add_head_scores_argument, check_head_scores, output_folder
from criticalkv.defaults import DEFAULT_METHOD

NAME = "bench"
#: how the library's messages name this command's options
SPELLING = {**FLAGS, "method": "--methods", "budget": "--budgets", "context_lengths": "--context-lengths"}
if TYPE_CHECKING:
    from criticalkv.bench.runner import BenchConfig

HELP = "time prefill, compression, decode and memory of methods (and kvpress's, if installed) side by side"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--context-lengths", type=ints_arg, default=[4096], help="prompt lengths in tokens, e.g. 1024,4096")
    p.add_argument(
        "--methods",
        type=methods_arg,
        default=["snapkv", "critical-snapkv", "adakv", "critical-adakv"],
        help="comma-separated methods (the full cache is always measured)",
    )
    p.add_argument("--budgets", type=budgets_arg, default=[0.2], help="kept fractions or token counts")
    p.add_argument("--batch-sizes", type=ints_arg, default=[1], help="rows decoded together, e.g. 1,4")
    p.add_argument("--decode-tokens", type=int, default=32, help="timed decoding steps per run")
    p.add_argument("--window", type=int, default=32, help="observation window")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds: every method is measured once per round, interleaved, the fastest kept and the spread of "
        "the ratios shown (1: no spread, bench warns)",
    )
    p.add_argument(
        "--kvpress",
        choices=["auto", "on", "off"],
        default="auto",
        help="compare with kvpress: auto (if importable), on (required), off",
    )
    p.add_argument(
        "--norm-precision",
        choices=["auto", "exact", "float32", "bfloat16", "float16"],
        default=None,
        help="override the Critical selections' value-norm precision (default: each method's own, 'auto')",
    )
    add_cache_arguments(p)
    p.add_argument("--out", type=Path, default=None, help="folder: records.jsonl, results.json, table.txt, bench.png")
    p.add_argument("--json", action="store_true", help="print the records as one JSON list on stdout")
    add_head_scores_argument(p)


def run(args: argparse.Namespace) -> int:
    from criticalkv.bench.figure import plot
    from criticalkv.bench.kvpress_impl import import_kvpress
    from criticalkv.bench.runner import load_records, run_bench
    from criticalkv.bench.tables import caveats, format_table
    from criticalkv.models import load_model
    from criticalkv.plotting import require_matplotlib
    from criticalkv.runs import write_text_atomically

    config = _config(args)
    if config.kvpress == "on":  # required: one sentence naming the extra, before the model loads
        require_extra("bench --kvpress on", "bench", "kvpress")
    if args.out is not None:
        output_folder(args.out, "--out")
        require_matplotlib()  # for bench.png, before anything is measured
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    config.check_model(model)  # e.g. a group size that does not divide the head dimension
    kvpress_model = None
    compare = config.kvpress != "off"
    if compare and import_kvpress() is not None:
        kvpress_model, _ = load_model(args.model, device=args.device, dtype=args.dtype)
    elif compare and config.kvpress == "auto":
        print("kvpress is not importable: measuring criticalkv only (pip install -e '.[bench]')", file=sys.stderr)
    notes: list[str] = []
    measured = run_bench(config, model, tokenizer, kvpress_model=kvpress_model, out=args.out, notes=notes)
    records = [r.to_dict() for r in measured]
    if args.out is not None:
        records = load_records(args.out / "records.jsonl")  # this run's and any resumed ones
        write_text_atomically(args.out / "results.json", json.dumps(records, indent=1) + "\n")
    warnings = caveats(config.repeats)
    for warning in warnings:
        print(warning, file=sys.stderr)
    table = format_table(records, [*notes, *warnings])
    title = f"criticalkv bench: {args.model} model, {records[0]['device'] if records else '-'}"
    if args.out is not None:
        write_text_atomically(args.out / "table.txt", title + "\n" + table + "\n")
        png = plot(records, args.out / "bench.png", title, warnings)
    if args.json:
        print(json.dumps(records))
        print(table, file=sys.stderr)
    else:
        print(title)
        print(table)
    if args.out is not None:
        print(f"plot: {png}  records: {args.out / 'records.jsonl'}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _config(args: argparse.Namespace) -> BenchConfig:
    """The benchmark's configuration, every input checked before the model loads."""
    from criticalkv.bench.runner import BenchConfig

    # the cache flags, parsed once: every row takes this spec's window, decode budget and storage with
    # its own method and budget (placeholders here, so that a row's error names --methods or --budgets)
    spec = spec_from_args(args, DEFAULT_METHOD, 1.0, args.window)
    return BenchConfig(
        context_lengths=args.context_lengths,
        methods=args.methods,
        budgets=args.budgets,
        batch_sizes=args.batch_sizes,
        decode_tokens=args.decode_tokens,
        window=spec.window,
        kvpress=args.kvpress,
        repeats=args.repeats,
        norm_precision=args.norm_precision,
        head_scores=check_head_scores(args.head_scores),
        decode=spec.decode,
        storage=spec.storage,
    )
