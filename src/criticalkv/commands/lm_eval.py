"""``criticalkv lm-eval ARGS``: lm-eval's own command line with the ``criticalkv`` model registered.

lm-eval 0.4.13 finds models only in its own registry (no entry points), so ``lm_eval --model
criticalkv`` needs the registration this command does first; every argument after ``lm-eval`` is
lm-eval's, e.g. ``criticalkv lm-eval --model criticalkv --model_args method=snapkv,budget=0.2
--tasks niah_single_1``.
"""

from __future__ import annotations

import argparse
import sys

from criticalkv.commands.common import UsageError, require_extra

NAME = "lm-eval"
HELP = "run lm-evaluation-harness with the criticalkv model registered (arguments are lm-eval's)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.prefix_chars = "\0"  # every argument, --help included, is lm-eval's, passed on as is
    parser.add_argument("lm_eval_args", nargs="*", help="lm-eval's arguments (lm_eval --help)")


def run(args: argparse.Namespace) -> int:
    require_extra("lm-eval", "lm-eval", "lm_eval")  # --help included: lm-eval prints it
    try:
        from lm_eval.__main__ import cli_evaluate

        import criticalkv.eval.lmeval  # noqa: F401  (registers the model)
    except ImportError as error:
        raise UsageError(str(error)) from None
    saved = sys.argv
    sys.argv = ["lm_eval", *args.lm_eval_args]
    try:
        cli_evaluate()
    except SystemExit as stop:  # lm-eval's --help and its usage errors exit
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = saved
    return 0
