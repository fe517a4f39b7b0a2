"""``criticalkv eval``: a resumable benchmark sweep (RULER, LongBench or your own JSONL data)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from criticalkv.commands import scale
from criticalkv.commands.cache_options import FLAGS, add_cache_arguments
from criticalkv.commands.common import (
    UsageError,
    add_model_arguments,
    budgets_arg,
    ints_arg,
    methods_arg,
    require_extra,
)
from criticalkv.commands.inputs import add_head_scores_argument, check_head_scores, output_folder
from criticalkv.defaults import MODES, NORM_PRECISIONS

NAME = "eval"
HELP = "run a resumable sweep of methods x budgets on RULER, LongBench or a JSONL dataset"
#: how the library's messages name this command's options
SPELLING = {**FLAGS, "method": "--methods", "budget": "--budgets"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    _add_data_arguments(p)
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
    p.add_argument("--budgets", type=budgets_arg, default=[0.1, 0.2, 0.4], help="kept fractions or token counts")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per (task, length) (default: 10 for RULER and LongBench; every line of a --dataset file)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="question-aware",
        help="compress the question with the context, or append it after",
    )
    p.add_argument("--window", type=int, default=None, help="observation window (default 32 aware, 64 agnostic)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on the task's tokens to generate")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated RULER samples")
    p.add_argument("--qa-source", default=None, help="SQuAD/HotpotQA data for qa_1/qa_2 (default: offline synthetic)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    p.add_argument(
        "--norm-precision",
        choices=NORM_PRECISIONS,
        default=None,
        help="dtype of the Critical selections' value norms (default: each method's own, 'auto')",
    )
    add_cache_arguments(p)
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


def _add_data_arguments(p: argparse.ArgumentParser) -> None:
    """Where the samples come from: a benchmark and its tasks, or your own file."""
    p.add_argument(
        "--benchmark",
        type=_benchmark,
        default="ruler",
        help="a registered benchmark: ruler, longbench, ... (--dataset: your own file)",
    )
    p.add_argument(
        "--tasks",
        default="all",
        help="comma-separated RULER tasks or 'all' (13); LongBench datasets or 'all' (21), 'en' (16), 'zh' (5)",
    )
    p.add_argument("--dataset", default=None, help="a JSONL file of {context, question, answers, metric?} lines")
    p.add_argument("--data-dir", default=None, help="LongBench: folder of its JSONL files (data.zip unpacked)")
    p.add_argument("--longbench-e", action="store_true", help="LongBench-E (13 datasets, length buckets)")


def _benchmark(name: str) -> str:
    """``--benchmark``: a name in the registry (:mod:`criticalkv.eval.benchmarks`), read only when a
    sweep's arguments are parsed, so a newly registered benchmark needs no flag of its own."""
    from criticalkv.eval.benchmarks import BENCHMARKS

    names = [n for n in BENCHMARKS if n != "dataset"]  # the dataset benchmark is --dataset PATH
    if name not in names:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {name!r} (choose from {', '.join(map(repr, names))}; --dataset PATH: your own file)"
        )
    return name


def run(args: argparse.Namespace) -> int:
    from criticalkv.eval.report import build_report
    from criticalkv.eval.results import check_run
    from criticalkv.plotting import require_matplotlib

    if args.ray is not None:
        require_extra("eval --ray", "ray", "ray")
    require_matplotlib()  # the report's plots: one sentence now, not after the sweep
    output_folder(args.out, "--out")  # a file, an unwritable folder: a sentence before any work
    tasks = None if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    if tasks == [] and not args.dataset:
        raise UsageError("no tasks given")
    kwargs: dict[str, Any] = {} if args.methods is None else {"methods": args.methods}
    head_scores = check_head_scores(args.head_scores)
    if head_scores is not None:
        kwargs["head_scores"] = str(head_scores)
    config = _config(args, tasks, kwargs)
    if args.dataset:  # say how many lines of each task run (--samples is per task)
        from criticalkv.eval.tasks import describe_usage, first_per_task, load_dataset_file

        print(describe_usage(args.dataset, first_per_task(load_dataset_file(args.dataset), args.samples)[1]))
    check_run(config.out, config.identity())  # a folder of another configuration: refused before the model loads
    scale.run_sweep_from_args(args, config)  # here, or on Ray with --ray
    text, plots = build_report(args.out, buckets=args.longbench_e)
    print(text)
    print("plots: " + ", ".join(str(p) for p in plots))
    return 0


def _config(args: argparse.Namespace, tasks: list[str] | None, kwargs: dict[str, Any]) -> Any:
    """The sweep of ``args``; its cache options as given (parsed once by the sweep, errors spelled
    with the flags by the command line)."""
    from criticalkv.eval.sweep import CACHE_OPTIONS, SweepConfig

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
        cache={name: getattr(args, name) for name in CACHE_OPTIONS},
        qa_source=args.qa_source,
        dataset=args.dataset,
        data_dir=args.data_dir,
        longbench_e=args.longbench_e,
        **kwargs,
    )
