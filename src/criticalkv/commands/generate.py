"""``criticalkv generate``: answer a question about a context with a compressed cache."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from criticalkv.commands.cache_options import add_cache_arguments, spec_from_args
from criticalkv.commands.common import UsageError, add_model_arguments, budget_arg, method_arg
from criticalkv.commands.inputs import add_head_scores_argument, check_head_scores, read_text_file
from criticalkv.defaults import DEFAULT_METHOD, DEFAULT_WINDOWS, MODES

if TYPE_CHECKING:
    from criticalkv.runtime import GenerationResult

NAME = "generate"
HELP = "answer a question about a context with a compressed cache"


def add_arguments(gen: argparse.ArgumentParser) -> None:
    add_model_arguments(gen)
    gen.add_argument(
        "--method", type=method_arg, default=DEFAULT_METHOD, help="the compression method (criticalkv methods)"
    )
    gen.add_argument("--budget", type=budget_arg, default=0.2, help="fraction of the prompt (0.2) or tokens (512)")
    gen.add_argument("--context-file", type=Path, required=True, help="UTF-8 text file with the context")
    gen.add_argument("--question", required=True, help="the question to answer about the context")
    gen.add_argument(
        "--mode",
        choices=MODES,
        default="question-aware",
        help="compress the question with the context, or append it after",
    )
    gen.add_argument("--window", type=int, default=None, help="observation window (default 32 aware, 64 agnostic)")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="the most tokens to generate")
    gen.add_argument("--min-new-tokens", type=int, default=None, help="at least M new tokens (EOS ignored before)")
    add_cache_arguments(gen)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    add_head_scores_argument(gen)


def run(args: argparse.Namespace) -> int:
    context = read_text_file(args.context_file, "--context-file")
    head_scores = check_head_scores(args.head_scores)
    if not context.strip():
        raise UsageError(f"context file {args.context_file} is empty")
    if not args.question.strip():
        raise UsageError("--question is empty")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    extra: dict[str, Any] = {}
    if args.min_new_tokens is not None:
        if not 0 <= args.min_new_tokens <= args.max_new_tokens:
            raise UsageError("--min-new-tokens must be between 0 and --max-new-tokens")
        extra["min_new_tokens"] = args.min_new_tokens

    window = DEFAULT_WINDOWS[args.mode] if args.window is None else args.window
    spec = spec_from_args(args, args.method, args.budget, window)  # every cache option, before the model loads
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
        spec=spec,
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        chat=not args.no_chat,
        head_scores=head_scores,
        **extra,
    )
    record = json_record(result, args.model, load_s)
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


def json_record(result: GenerationResult, model: str, load_s: float) -> dict[str, Any]:
    """The ``--json`` line: the answer, the configuration, the memory and the times."""
    return {
        "answer": result.answers[0],
        "method": result.method,
        "budget": result.budget,
        "mode": result.mode,
        "window": result.window,
        "model": model,
        "context_tokens": result.context_tokens[0],
        "question_tokens": result.question_tokens[0],
        "new_tokens": result.new_tokens[0],
        "kv_bytes": result.kv_bytes,
        "kv_bytes_full": result.kv_bytes_full,
        "kv_ratio": result.kv_bytes / result.kv_bytes_full if result.kv_bytes_full else None,
        "kv_bytes_peak": result.kv_bytes_peak,
        "kv_bytes_final": result.kv_bytes_final,
        "decode_budget": result.decode_budget,
        "decode_interval": result.decode_interval,
        "kv_bits": result.kv_bits,
        "storage_bits": result.storage_bits,
        "kv_bits_per_element": result.kv_bits_per_element,
        "kv_bits_per_element_final": result.kv_bits_per_element_final,
        "ttft_s": result.ttft_s,
        "total_s": result.total_s,
        "load_s": load_s,
    }
