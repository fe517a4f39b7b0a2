"""Argument types and helpers shared by the subcommands."""

from __future__ import annotations

import argparse

from criticalkv.budgets.resolve import Budget, parse_budget
from criticalkv.methods import get_method


class UsageError(Exception):
    """A problem with the command line that the user can fix (exit status 2)."""


def budget_arg(text: str) -> Budget:
    try:
        return parse_budget(text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def budgets_arg(text: str) -> list[Budget]:
    return [budget_arg(part) for part in text.split(",") if part.strip()]


def method_arg(name: str) -> str:
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
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU)")
