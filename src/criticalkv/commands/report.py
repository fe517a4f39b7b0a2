"""``criticalkv report DIR``: regenerate summary.csv, tables and plots from results.jsonl."""

from __future__ import annotations

import argparse
from pathlib import Path

from criticalkv.commands.common import UsageError
from criticalkv.commands.inputs import output_folder

NAME = "report"
HELP = (
    "rebuild summary.csv, the tables and the plots of a sweep folder from its results.jsonl; or compare "
    "lm-eval runs (criticalkv lm-eval --log_samples folders) paired per document"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "out",
        type=Path,
        nargs="+",
        help="a sweep folder written by `criticalkv eval`; or lm-eval output folders (--output_path, with "
        "--log_samples), one or several, compared paired per document",
    )
    p.add_argument("--bar-budget", type=float, default=None, help="budget of the per-task bar plot")
    p.add_argument(
        "--buckets",
        action="store_true",
        help="LongBench(-E): also group by length bucket 0-4k/4-8k/8k+ (summary_buckets.csv)",
    )


def run(args: argparse.Namespace) -> int:
    from criticalkv.eval.report import build_report, find_runs, format_lmeval_report, is_lmeval_folder

    for folder in args.out:
        if not folder.is_dir():
            raise UsageError(f"{folder} is not a folder")
    lmeval = [f for f in args.out if not (f / "results.jsonl").exists() and is_lmeval_folder(f)]
    if lmeval:
        if len(lmeval) != len(args.out):
            raise UsageError("give either one sweep folder or lm-eval output folders, not both")
        print(format_lmeval_report(find_runs(lmeval)))  # nothing is written into lm-eval's folders
        return 0
    if len(args.out) != 1:
        raise UsageError("a sweep report takes one folder (several folders are for lm-eval runs)")
    (out,) = args.out
    args.out = out
    output_folder(args.out, "the report's folder")  # it writes summary.csv and the plots there
    text, plots = build_report(args.out, args.bar_budget, buckets=args.buckets)
    print(text)
    print("plots: " + ", ".join(str(p) for p in plots))
    return 0
