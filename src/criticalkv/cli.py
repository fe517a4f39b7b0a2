"""The ``criticalkv`` command (subcommands live in :mod:`criticalkv.commands`)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from criticalkv.commands import bench, demo, generate, head_scores, methods, serve
from criticalkv.commands import eval as eval_command
from criticalkv.commands import lm_eval as lm_eval_command
from criticalkv.commands import perturbation as perturbation_command
from criticalkv.commands import report as report_command
from criticalkv.commands.cache_options import FLAGS
from criticalkv.commands.common import DISK_ERRNOS, DefaultsHelpFormatter, UsageError, disk_error
from criticalkv.commands.version import library_version
from criticalkv.options import OptionError

#: subcommand modules, in the order ``--help`` lists them
COMMANDS: list[ModuleType] = [
    methods,
    generate,
    demo,
    eval_command,
    report_command,
    perturbation_command,
    head_scores,
    bench,
    serve,
    lm_eval_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="criticalkv",
        description="KV-cache compression by output perturbation (CriticalKV) with a physically smaller cache.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    parser.add_argument("--version", action="version", version=f"criticalkv {library_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.add_arguments(sub.add_parser(module.NAME, help=module.HELP, formatter_class=DefaultsHelpFormatter))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``criticalkv`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING))
    command = {m.NAME: m for m in COMMANDS}[args.command]
    try:
        return int(command.run(args))
    except OptionError as err:  # a library check about an option: named as this command's flag
        logging.getLogger("criticalkv").debug("command failed", exc_info=True)
        print(f"criticalkv: error: {err.spelled(getattr(command, 'SPELLING', FLAGS))}", file=sys.stderr)
        return 2
    except (UsageError, ValueError) as err:  # what the user can fix; anything else is a bug: its traceback shows
        logging.getLogger("criticalkv").debug("command failed", exc_info=True)
        print(f"criticalkv: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full or read-only disk, a folder without permission: one sentence
        if err.errno not in DISK_ERRNOS:
            raise
        logging.getLogger("criticalkv").debug("command failed", exc_info=True)
        print(f"criticalkv: error: {disk_error(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
