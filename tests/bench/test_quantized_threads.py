"""benchmarks/quantized_threads.py: its layout and its one-line report (tiny sizes; no timing asserted)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quantized_threads.py"


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_the_script_reports_both_thread_counts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("quantized_threads", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = module.layout(512, 4, 64)
    assert int(x["lengths"].sum()) > 0 and x["query"].shape == (3, 3, 64)
    argv = ["quantized_threads.py", "--prompt-tokens", "512", "--rounds", "2", "--calls", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    module.main()
    out = capsys.readouterr().out
    assert "512 tokens, 4 bits, group 64: 1 thread" in out and "2 threads" in out and "speed-up" in out
