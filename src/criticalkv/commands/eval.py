"""``criticalkv eval``: a resumable benchmark sweep (RULER, LongBench or your own JSONL data)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from criticalkv.commands import scale
from criticalkv.commands.common import UsageError, add_model_arguments, budgets_arg, ints_arg, methods_arg
from criticalkv.commands.inputs import (
    UNDERSCORED_OPTIONS,
    add_head_scores_argument,
    add_storage_arguments,
    check_head_scores,
    flag_names,
)
from criticalkv.runtime import MODES
from criticalkv.scores.value_norms import NORM_PRECISIONS

NAME = "eval"
HELP = "run a resumable sweep of methods x budgets on RULER, LongBench or a JSONL dataset"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--benchmark", choices=["ruler", "longbench"], default="ruler")
    p.add_argument(
        "--tasks",
        default="all",
        help="comma-separated RULER tasks or 'all' (13); LongBench datasets or 'all' (21), 'en' (16), 'zh' (5)",
    )
    p.add_argument("--dataset", default=None, help="a JSONL file of {context, question, answers, metric?} lines")
    p.add_argument("--data-dir", default=None, help="LongBench: folder of its JSONL files (data.zip unpacked)")
    p.add_argument("--longbench-e", action="store_true", help="LongBench-E (13 datasets, length buckets)")
    p.add_argument(
        "--lengths",
        type=ints_arg,
        default=[1024],
        help="context lengths in tokens, e.g. 1024,2048 (LongBench: max prompt tokens, middle-truncated)",
    )
    p.add_argument(
        "--methods",
        type=methods_arg,
        default=None,
        help="comma-separated methods, each NAME or NAME:KEY=VALUE[:KEY=VALUE...] with options of its parts "
        "(e.g. critical-snapkv:eps=0); a spec is recorded under its canonical name",
    )
    p.add_argument("--budgets", type=budgets_arg, default=[0.1, 0.2, 0.4])
    p.add_argument("--samples", type=int, default=10, help="samples per (task, length)")
    p.add_argument("--mode", choices=MODES, default="question-aware")
    p.add_argument("--window", type=int, default=None, help="observation window (default 32 aware, 64 agnostic)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on the task's tokens to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qa-source", default=None, help="SQuAD/HotpotQA data for qa_1/qa_2 (default: offline synthetic)")
    p.add_argument("--no-chat", action="store_true")
    p.add_argument(
        "--norm-precision",
        choices=NORM_PRECISIONS,
        default=None,
        help="dtype of the Critical selections' value norms (default: each method's own, 'auto')",
    )
    p.add_argument(
        "--kv-bits", type=int, choices=[16, 8, 4], default=None, help="store the kept entries in 8 or 4 bits"
    )
    add_storage_arguments(p)
    p.add_argument(
        "--decode-budget",
        type=int,
        default=None,
        help="hold each compressed cache at N entries per KV head while it decodes (and while the answer is scored)",
    )
    p.add_argument(
        "--decode-interval", type=int, default=None, help="re-select after K new entries per head (default 64)"
    )
    add_head_scores_argument(p)
    p.add_argument("--out", type=Path, required=True, help="run folder (results.jsonl, run.json, summary.csv, plots)")
    p.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="if another process is writing to --out, wait this long for it before refusing (default 10; -1: forever)",
    )
    scale.add_arguments(p)  # --device-map, --ray ...


def run(args: argparse.Namespace) -> int:
    from criticalkv.eval.report import build_report
    from criticalkv.eval.store import check_run

    tasks = None if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    if tasks == [] and not args.dataset:
        raise UsageError("no tasks given")
    kwargs: dict[str, Any] = {} if args.methods is None else {"methods": args.methods}
    head_scores = check_head_scores(args.head_scores)
    if head_scores is not None:
        kwargs["head_scores"] = str(head_scores)
    try:
        config = _config(args, tasks, kwargs)
    except (TypeError, ValueError) as err:
        if all(getattr(args, name) is None for name in UNDERSCORED_OPTIONS):
            raise
        raise UsageError(flag_names(str(err))) from None
    if args.dataset:  # say how many lines of each task run (--samples is per task)
        from criticalkv.eval.dataset import describe_usage, first_per_task, load_dataset_file

        print(describe_usage(args.dataset, first_per_task(load_dataset_file(args.dataset), args.samples)[1]))
    check_run(config.out, config.identity())  # a folder of another configuration: refused before the model loads
    try:
        scale.run_sweep_from_args(args, config)  # here, or on Ray with --ray
    except ValueError as err:
        if args.kv_bits is None:
            raise
        raise UsageError(flag_names(str(err))) from None  # e.g. a group size that does not divide the head dim
    text, plots = build_report(args.out, buckets=args.longbench_e)
    print(text)
    print("plots: " + ", ".join(str(p) for p in plots))
    return 0


def _config(args: argparse.Namespace, tasks: list[str] | None, kwargs: dict[str, Any]) -> Any:
    from criticalkv.eval.config import SweepConfig

    return SweepConfig(
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
        norm_precision=args.norm_precision,
        kv_bits=None if args.kv_bits in (None, 16) else args.kv_bits,
        kv_group_size=args.kv_group_size,
        kv_residual=args.kv_residual,
        decode_budget=args.decode_budget,
        decode_interval=args.decode_interval,
        qa_source=args.qa_source,
        dataset=args.dataset,
        data_dir=args.data_dir,
        longbench_e=args.longbench_e,
        **kwargs,
    )
