"""``criticalkv perturbation``: per-head output perturbation of each base method vs its Critical variant."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from criticalkv.commands.common import UsageError, add_model_arguments, budgets_arg
from criticalkv.commands.inputs import output_folder

NAME = "perturbation"
HELP = "per-head output perturbation, its bound and hidden-state drift: base methods vs their Critical variants"


def _bases_arg(text: str) -> list[str]:
    from criticalkv.analysis.experiment import critical_variant

    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no methods given; pass e.g. snapkv,adakv")
    for name in names:
        try:
            critical_variant(name)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument(
        "--methods", type=_bases_arg, default=["snapkv", "adakv"], help="base methods (default snapkv,adakv)"
    )
    p.add_argument("--budgets", type=budgets_arg, default=[0.025, 0.05, 0.1, 0.2, 0.4], help="per-head budgets")
    p.add_argument("--samples", type=int, default=8, help="needle samples (default 8)")
    p.add_argument("--length", type=int, default=2048, help="context length in tokens (default 2048)")
    p.add_argument("--window", type=int, default=32, help="observation window (default 32); budgets must hold it")
    p.add_argument("--seed", type=int, default=0, help="sample i uses seed + i")
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    p.add_argument("--out", type=Path, default=Path("runs/perturbation"), help="output folder (resumable)")
    p.add_argument("--report-only", action="store_true", help="only regenerate heads.csv, summary.md and plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _command(args: argparse.Namespace) -> str:
    parts = ["criticalkv", "perturbation", "--model", str(args.model)]
    parts += ["--methods", ",".join(args.methods), "--budgets", ",".join(str(b) for b in args.budgets)]
    parts += ["--samples", str(args.samples), "--length", str(args.length), "--window", str(args.window)]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    if args.no_chat:
        parts.append("--no-chat")
    if args.device:
        parts += ["--device", str(args.device)]
    if args.dtype:
        parts += ["--dtype", str(args.dtype)]
    parts += ["--out", str(args.out)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    from criticalkv.analysis.experiment import RunSpec, check_budgets, comparison_configs, run_perturbation
    from criticalkv.analysis.experiment_report import write_report
    from criticalkv.plotting import require_matplotlib

    require_matplotlib()  # for the heatmaps and curves, before anything is measured
    output_folder(args.out, "--out")
    if args.report_only:
        report = write_report(args.out)
        print(report.text)
        return 0
    if args.samples < 1:
        raise UsageError("--samples must be at least 1")
    spec = RunSpec(model=str(args.model), length=args.length, window=args.window, seed=args.seed, chat=not args.no_chat)
    comparison_configs(args.methods, args.budgets)
    check_budgets(args.budgets, args.length, args.window)  # before loading the model

    from criticalkv.models import load_model

    started = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    command = _command(args)
    outcome = run_perturbation(
        model,
        tokenizer,
        spec,
        args.out,
        bases=args.methods,
        budgets=args.budgets,
        samples=args.samples,
        command=command,
        progress=not args.no_progress,
    )
    report = write_report(args.out, command=command)
    print(report.text)
    print(
        f"{outcome.measured} rows measured, {outcome.skipped} already done; "
        f"wrote {report.heads}, {report.summary}, {', '.join(str(p) for p in report.plots)} "
        f"({time.perf_counter() - started:.0f} s)"
    )
    return 0
