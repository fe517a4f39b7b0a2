"""The ``criticalkv`` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from criticalkv.budgets.resolve import parse_budget
from criticalkv.methods import available_methods, get_method
from criticalkv.runtime import MODES

logger = logging.getLogger("criticalkv")


class UsageError(Exception):
    """A problem with the command line that the user can fix."""


def _budget(text: str) -> float | int:
    try:
        return parse_budget(text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _budgets(text: str) -> list[float | int]:
    return [_budget(part) for part in text.split(",") if part.strip()]


def _method(name: str) -> str:
    try:
        return get_method(name).name
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _methods(text: str) -> list[str]:
    return [_method(part.strip()) for part in text.split(",") if part.strip()]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="default", help="'default' (SmolLM2-135M-Instruct, offline), a folder or a hub id"
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="criticalkv",
        description="KV-cache compression by output perturbation (CriticalKV) with a physically smaller cache.",
    )
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("methods", help="list the registered methods")

    gen = sub.add_parser("generate", help="answer a question about a context with a compressed cache")
    _add_model_args(gen)
    gen.add_argument("--method", type=_method, default="critical-adakv")
    gen.add_argument("--budget", type=_budget, default=0.2, help="fraction of the prompt (0.2) or tokens (512)")
    gen.add_argument("--context-file", type=Path, required=True, help="UTF-8 text file with the context")
    gen.add_argument("--question", required=True)
    gen.add_argument("--mode", choices=MODES, default="question-aware")
    gen.add_argument("--window", type=int, default=None, help="observation window (default 32 aware, 64 agnostic)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    demo = sub.add_parser("demo", help="needle-retrieval comparison of methods: table and PNG plot")
    _add_model_args(demo)
    demo.add_argument("--methods", type=_methods, default=None, help="comma-separated (default: the five core ones)")
    demo.add_argument("--budgets", type=_budgets, default=[0.1, 0.2])
    demo.add_argument("--samples", type=int, default=8)
    demo.add_argument("--length", type=int, default=2048, help="context length in tokens")
    demo.add_argument("--window", type=int, default=16, help="observation window (default 16: the question)")
    demo.add_argument("--out", type=Path, default=Path("demo-out"))
    return parser


def _cmd_methods() -> int:
    width = max(len(name) for name in available_methods())
    for name in available_methods():
        m = get_method(name)
        print(f"{name:<{width}}  {m.description}  [{m.reference}]")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if not args.context_file.is_file():
        raise UsageError(f"context file {args.context_file} does not exist")
    context = args.context_file.read_text(encoding="utf-8")
    if not context.strip():
        raise UsageError(f"context file {args.context_file} is empty")
    if not args.question.strip():
        raise UsageError("--question is empty")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    from criticalkv.models import load_model
    from criticalkv.runtime import generate

    started = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - started
    result = generate(
        model,
        tokenizer,
        context,
        args.question,
        method=args.method,
        budget=args.budget,
        mode=args.mode,
        window=args.window,
        max_new_tokens=args.max_new_tokens,
        chat=not args.no_chat,
    )
    record = {
        "answer": result.answers[0],
        "method": result.method,
        "budget": result.budget,
        "mode": result.mode,
        "window": result.window,
        "model": args.model,
        "context_tokens": result.context_tokens[0],
        "question_tokens": result.question_tokens[0],
        "new_tokens": result.new_tokens[0],
        "kv_bytes": result.kv_bytes,
        "kv_bytes_full": result.kv_bytes_full,
        "kv_ratio": result.kv_bytes / result.kv_bytes_full if result.kv_bytes_full else None,
        "ttft_s": result.ttft_s,
        "total_s": result.total_s,
        "load_s": load_s,
    }
    if args.json:
        print(json.dumps(record))
    else:
        print(result.answers[0])
        print(
            f"[{result.method} @ {result.budget}, {result.mode}: {record['context_tokens']} context tokens, "
            f"KV {result.kv_bytes / 2**20:.2f} MB of {result.kv_bytes_full / 2**20:.2f} MB, "
            f"TTFT {result.ttft_s:.2f} s]",
            file=sys.stderr,
        )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from criticalkv.eval.demo import DEMO_METHODS, run_demo, write_outputs
    from criticalkv.models import load_model

    if args.samples < 1:
        raise UsageError("--samples must be at least 1")
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    started = time.perf_counter()
    rows = run_demo(
        model,
        tokenizer,
        methods=args.methods or DEMO_METHODS,
        budgets=args.budgets,
        samples=args.samples,
        length=args.length,
        window=args.window,
    )
    title = f"needle retrieval, {args.model} model, {args.length} tokens, question-aware, {args.samples} samples"
    table, png = write_outputs(rows, args.out, title)
    print(title)
    print(table)
    print(f"plot: {png}  rows: {args.out / 'rows.jsonl'}  ({time.perf_counter() - started:.0f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``criticalkv`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING))
    try:
        if args.command == "methods":
            return _cmd_methods()
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "demo":
            return _cmd_demo(args)
    except (UsageError, ValueError, TypeError) as err:
        print(f"criticalkv: error: {err}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
