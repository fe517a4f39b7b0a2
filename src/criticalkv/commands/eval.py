"""``criticalkv eval``: a resumable benchmark sweep (RULER or your own JSONL data)."""

from __future__ import annotations

import argparse
from pathlib import Path

from criticalkv.commands.common import UsageError, add_model_arguments, budgets_arg, methods_arg
from criticalkv.runtime import MODES

NAME = "eval"
HELP = "run a resumable sweep of methods x budgets on RULER tasks or a JSONL dataset"


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from err


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--benchmark", choices=["ruler"], default="ruler")
    p.add_argument("--tasks", default="all", help="comma-separated RULER tasks, or 'all' (13 tasks)")
    p.add_argument("--dataset", default=None, help="a JSONL file of {context, question, answers, metric?} lines")
    p.add_argument("--lengths", type=_ints, default=[1024], help="context lengths in tokens, e.g. 1024,2048")
    p.add_argument("--methods", type=methods_arg, default=None, help="comma-separated methods")
    p.add_argument("--budgets", type=budgets_arg, default=[0.1, 0.2, 0.4])
    p.add_argument("--samples", type=int, default=10, help="samples per (task, length)")
    p.add_argument("--mode", choices=MODES, default="question-aware")
    p.add_argument("--window", type=int, default=None, help="observation window (default 32 aware, 64 agnostic)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on RULER's tokens to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qa-source", default=None, help="SQuAD/HotpotQA data for qa_1/qa_2 (default: offline synthetic)")
    p.add_argument("--no-chat", action="store_true")
    p.add_argument("--out", type=Path, required=True, help="run folder (results.jsonl, run.json, summary.csv, plots)")


def run(args: argparse.Namespace) -> int:
    from criticalkv.eval.report import build_report
    from criticalkv.eval.ruler import TASK_NAMES
    from criticalkv.eval.runner import SweepConfig, run_sweep
    from criticalkv.models import load_model

    tasks = list(TASK_NAMES) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks and not args.dataset:
        raise UsageError("no tasks given")
    kwargs = {} if args.methods is None else {"methods": args.methods}
    config = SweepConfig(
        out=args.out,
        benchmark="dataset" if args.dataset else args.benchmark,
        tasks=tasks if not args.dataset else [],
        lengths=args.lengths,
        budgets=args.budgets,
        samples=args.samples,
        mode=args.mode,
        model=args.model,
        window=args.window,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        chat=not args.no_chat,
        qa_source=args.qa_source,
        dataset=args.dataset,
        **kwargs,
    )
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    run_sweep(config, model, tokenizer)
    text, plots = build_report(args.out)
    print(text)
    print("plots: " + ", ".join(str(p) for p in plots))
    return 0
