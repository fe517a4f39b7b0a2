"""``criticalkv demo``: the needle-retrieval comparison behind ``make demo``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from criticalkv.commands.common import UsageError, add_model_arguments, budgets_arg, methods_arg
from criticalkv.commands.inputs import output_folder

NAME = "demo"
HELP = "needle-retrieval comparison of methods: table and PNG plot"


def add_arguments(demo: argparse.ArgumentParser) -> None:
    add_model_arguments(demo)
    demo.add_argument(
        "--methods",
        type=methods_arg,
        default=None,
        help="comma-separated (default: full, the SnapKV and AdaKV pairs, DefensiveKV and Layer-DefensiveKV)",
    )
    demo.add_argument("--budgets", type=budgets_arg, default=[0.1, 0.2], help="kept fractions or token counts")
    demo.add_argument(
        "--samples",
        type=int,
        default=4,
        help="needle samples per method and budget (4: the 7-method demo took 125 s on 2 quiet CPU cores)",
    )
    demo.add_argument("--length", type=int, default=2048, help="context length in tokens")
    demo.add_argument("--window", type=int, default=16, help="observation window (default 16: the question)")
    demo.add_argument("--out", type=Path, default=Path("demo-out"), help="folder: demo.png, summary.json, rows.jsonl")


def run(args: argparse.Namespace) -> int:
    from criticalkv.eval.demo import DEMO_METHODS, run_demo, write_outputs
    from criticalkv.models import load_model
    from criticalkv.plotting import require_matplotlib

    if args.samples < 1:
        raise UsageError("--samples must be at least 1")
    output_folder(args.out, "--out")
    require_matplotlib()  # for demo.png, before the model loads
    methods = args.methods or DEMO_METHODS
    print(
        f"demo: {len(methods)} methods ({', '.join(methods)}) x budgets {','.join(map(str, args.budgets))}, "
        f"{args.samples} needle samples of {args.length} tokens (--samples and --length change them; "
        "docs/results/demo-default.md has 8 samples)",
        flush=True,
    )
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    load_before = _load()
    started = time.perf_counter()
    rows = run_demo(
        model,
        tokenizer,
        methods=methods,
        budgets=args.budgets,
        samples=args.samples,
        length=args.length,
        window=args.window,
    )
    title = f"needle retrieval, {args.model} model, {args.length} tokens, question-aware, {args.samples} samples"
    table, png = write_outputs(rows, args.out, title)
    print(title)
    print(table)
    for warning in _time_warnings(load_before, _load()):
        print(warning, file=sys.stderr)
    print(f"plot: {png}  rows: {args.out / 'rows.jsonl'}  ({time.perf_counter() - started:.0f} s)")
    return 0


def _load() -> float | None:
    """The 1-minute load average, where the platform has one."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _time_warnings(before: float | None, after: float | None) -> list[str]:
    """The bench's warning for the time columns, where the load was above the cores before or after."""
    from criticalkv.bench.tables import load_caveat

    loads = [x for x in (before, after) if x is not None]
    warnings = load_caveat(max(loads), None) if loads else []
    return [
        w + " (the 'compress ms' and 'decode ms/tok' columns; accuracy and KV bytes are not affected)" for w in warnings
    ]
