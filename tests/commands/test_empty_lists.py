"""An empty list option is refused at parse time (issue 41): ``--budgets ""`` ran a sweep of
``full`` alone, ``--methods ""`` the default's; benchmarks/gpu_check.py checks its own lists too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from criticalkv.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--out", "x", "--budgets", ""],
        ["eval", "--out", "x", "--methods", " , "],
        ["eval", "--out", "x", "--lengths", ""],
        ["bench", "--out", "x", "--budgets", ""],
        ["bench", "--out", "x", "--methods", ""],
        ["bench", "--out", "x", "--batch-sizes", ","],
        ["perturbation", "--out", "x", "--budgets", ""],
        ["head-scores", "--out", "x", "--lengths", ""],
    ],
)
def test_an_empty_list_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert "the list is empty" in capsys.readouterr().err


def _gpu_check() -> object:
    spec = importlib.util.spec_from_file_location("gpu_check_lists", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--methods", "bogus"], "bogus"),
        (["--budgets", "2"], "token count"),
        (["--budgets", "1.5"], "not a fraction"),
        (["--budgets", ""], "the list is empty"),
    ],
)
def test_gpu_checks_lists_are_checked_before_any_work(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_check = _gpu_check()
    with pytest.raises(SystemExit) as exit_:
        gpu_check.parse_args(argv)  # type: ignore[attr-defined]
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert gpu_check.parse_args([]).budgets == [0.1, 0.2]  # type: ignore[attr-defined]
