"""Help that helps (issue 29, point 5): every option has help text and shows its default, and no
``--help`` imports torch or transformers (its speed is measured in benchmarks/help_time.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from criticalkv.cli import COMMANDS, build_parser

SRC = Path(__file__).resolve().parents[2] / "src"
SKIPPED = (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [("criticalkv", parser), *subs.choices.items()]


@pytest.mark.parametrize(("name", "parser"), _parsers(), ids=[n for n, _ in _parsers()])
def test_every_option_has_help_and_shows_its_default(name: str, parser: argparse.ArgumentParser) -> None:
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, SKIPPED):
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help, f"criticalkv {name} {flag} has no help text"
        shown = formatter._expand_help(action) if action.option_strings else action.help
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in shown.lower(), f"criticalkv {name} {flag}: its help does not show its default"


def test_a_listed_default_is_shown_as_given() -> None:
    text = next(p for n, p in _parsers() if n == "eval").format_help()
    assert "default: 0.1,0.2,0.4" in " ".join(text.split())


#: commands whose --help is another program's: ``lm-eval`` hands every argument to lm-eval's CLI
FOREIGN_HELP = ("lm-eval",)


def test_help_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import contextlib, io, json, sys\n"
        "from criticalkv.cli import COMMANDS, main\n"
        f"for argv in [[]] + [[m.NAME] for m in COMMANDS if m.NAME not in {FOREIGN_HELP!r}]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main([*argv, '--help'])\n"
        "        except SystemExit:\n"
        "            pass\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], "a --help imported a heavy module"
    assert len(COMMANDS) >= 9


def test_the_package_imports_its_public_names_on_first_use() -> None:
    code = "import sys, criticalkv; a = 'torch' in sys.modules; criticalkv.CacheSpec; print(a, 'torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.stdout.split() == ["False", "True"], done.stderr
