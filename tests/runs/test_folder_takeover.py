"""A run stopped before its first result (SIGTERM during the model load, or a command refused after
``run.json`` was written) leaves a folder the corrected command can use (issue 30, case 6): it
was refused as "a different configuration" although it held no results."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from criticalkv.eval import results as sweep_results


def test_a_folder_without_results_is_taken_over_and_one_with_results_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    sweep_results.open_run(out, {"benchmark": "ruler", "window": 8}, {"window": 8})  # then stopped: no result
    with caplog.at_level(logging.WARNING):
        sweep_results.open_run(out, {"benchmark": "ruler", "window": 16}, {"window": 16})  # the corrected command
    assert "holds no results yet: its configuration is replaced (window: 8 there, 16 now)" in caplog.text
    (out / "results.jsonl").write_text('{"task": "t"}\n')
    with pytest.raises(ValueError, match=r"different configuration \(window: 16 there, 32 now\)"):
        sweep_results.open_run(out, {"benchmark": "ruler", "window": 32}, {"window": 32})


def test_a_torn_line_alone_is_no_result(tmp_path: Path) -> None:
    out = tmp_path / "run"
    sweep_results.open_run(out, {"benchmark": "ruler", "window": 8}, {"window": 8})
    (out / "results.jsonl").write_text('{"task": ')  # killed mid-write of the first line
    sweep_results.open_run(out, {"benchmark": "ruler", "window": 16}, {"window": 16})


def test_the_check_before_the_model_loads_agrees(tmp_path: Path) -> None:
    out = tmp_path / "run"
    sweep_results.open_run(out, {"benchmark": "ruler", "window": 8}, {"window": 8})
    sweep_results.check_run(out, {"benchmark": "ruler", "window": 16})  # no results: the corrected command may run
    (out / "results.jsonl").write_text('{"task": "t"}\n')
    with pytest.raises(ValueError, match="different configuration"):
        sweep_results.check_run(out, {"benchmark": "ruler", "window": 16})
