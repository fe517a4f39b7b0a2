"""Argument types and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from criticalkv.budgets.resolve import Budget


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows every option's default: ``(default: X)`` after any help that does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return text
        shown = ",".join(str(x) for x in default) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class UsageError(Exception):
    """A problem with the command line that the user can fix (exit status 2)."""


def budget_arg(text: str) -> Budget:
    from criticalkv.budgets.resolve import parse_budget  # here, not at import: --help never loads torch

    try:
        return parse_budget(text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def budgets_arg(text: str) -> list[Budget]:
    return [budget_arg(part) for part in text.split(",") if part.strip()]


def method_arg(name: str) -> str:
    from criticalkv.methods import get_method  # here, not at import: --help never loads torch

    try:
        return get_method(name).name
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def methods_arg(text: str) -> list[str]:
    return [method_arg(part.strip()) for part in text.split(",") if part.strip()]


def ints_arg(text: str) -> list[int]:
    """Comma-separated integers, e.g. ``1024,2048``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from err


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct, offline), a folder or hub id")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16 or float16 (default on CPU: bfloat16 where it runs in hardware, else float32)",
    )
