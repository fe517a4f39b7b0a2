"""Argument types and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import errno
import importlib.util
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


def require_extra(command: str, extra: str, *modules: str) -> None:
    """Refuse ``command`` in one sentence naming ``extra`` if any of ``modules`` is not installed.

    Called first thing in an optional command's ``run``, before any model loads (nothing is imported:
    the modules are only looked up).
    """
    missing = [name for name in modules if _absent(name)]
    if missing:
        raise UsageError(
            f"criticalkv {command} needs the [{extra}] extra ({', '.join(missing)} not installed): "
            f"pip install -e '.[{extra}]' (in a clone; or: pip install 'criticalkv[{extra}]')"
        )


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package missing, or a module left half-imported
        return True


#: the errors of a disk the user can fix: full, over quota, read-only, not permitted
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})


def disk_error(error: OSError) -> str:
    """One sentence for an ``OSError`` of :data:`DISK_ERRNOS` (naming its file where it has one)."""
    where = f"write {error.filename}" if error.filename else "write its output"
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"could not {where}: {error.strerror}; free some space there (or pass another folder) and run it again"
    return f"could not {where}: {error.strerror}; pass a folder you can write to"


def budget_arg(text: str) -> Budget:
    from criticalkv.budgets.resolve import parse_budget  # here, not at import: --help never loads torch

    try:
        return parse_budget(text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def list_parts(text: str, example: str) -> list[str]:
    """The comma-separated parts of ``text``; an empty list (``--budgets ""``) is refused, never read
    as "none" or as the default (``example``: what the error suggests)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"the list is empty ({text!r}); pass e.g. {example}, or omit the option")
    return parts


def budgets_arg(text: str) -> list[Budget]:
    return [budget_arg(part) for part in list_parts(text, "0.1,0.2")]


def method_arg(name: str) -> str:
    from criticalkv.methods import get_method  # here, not at import: --help never loads torch

    try:
        return get_method(name).name
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def methods_arg(text: str) -> list[str]:
    return [method_arg(part) for part in list_parts(text, "snapkv,critical-adakv")]


def ints_arg(text: str) -> list[int]:
    """Comma-separated integers, e.g. ``1024,2048``."""
    parts = list_parts(text, "1024,2048")
    try:
        return [int(x) for x in parts]
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
