"""``criticalkv report DIR``: regenerate summary.csv, tables and plots from results.jsonl."""

from __future__ import annotations

import argparse
from pathlib import Path

from criticalkv.commands.common import UsageError
from criticalkv.commands.inputs import output_folder

NAME = "report"
HELP = "rebuild summary.csv, the tables and the plots of a sweep folder from its results.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, help="a sweep folder written by `criticalkv eval`")
    p.add_argument("--bar-budget", type=float, default=None, help="budget of the per-task bar plot")
    p.add_argument(
        "--buckets",
        action="store_true",
        help="LongBench(-E): also group by length bucket 0-4k/4-8k/8k+ (summary_buckets.csv)",
    )


def run(args: argparse.Namespace) -> int:
    from criticalkv.eval.report import build_report

    if not args.out.is_dir():
        raise UsageError(f"{args.out} is not a folder")
    output_folder(args.out, "the report's folder")  # it writes summary.csv and the plots there
    text, plots = build_report(args.out, args.bar_budget, buckets=args.buckets)
    print(text)
    print("plots: " + ", ".join(str(p) for p in plots))
    return 0
