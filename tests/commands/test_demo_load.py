"""Issue 42, point 6: the demo warns under its time columns when the machine was loaded, as bench does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import criticalkv.eval.demo as demo
import criticalkv.models
from criticalkv.cli import main


def _rows(**_: Any) -> list[demo.DemoRow]:
    return [demo.DemoRow(0, method, 0.2, 1.0, 1.0, "7", "7", 10, 50, 0.01, 0.1, 5) for method in ("full", "snapkv")]


@pytest.mark.parametrize(("load", "warned"), [(9.0, True), (0.5, False)])
def test_the_demo_warns_when_the_load_is_above_the_cores(
    load: float, warned: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(criticalkv.models, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: _rows())
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert main(["demo", "--methods", "full,snapkv", "--budgets", "0.2", "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert ("load average (9.00 over 1 min) is above the 2 cores" in err) is warned
    assert ("decode ms/tok" in err) is warned
