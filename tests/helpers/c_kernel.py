"""The C decode kernel in tests: a marker skipping where no compiler is, and a fresh kernel folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from criticalkv.ops.cpu import build

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler (cc or gcc) on PATH"
)


def fresh_kernel_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the kernel cache at ``tmp_path`` with no kernel choice and nothing remembered, so a
    test compiles (or fails to) on its own; returns the kernel folder (not yet created)."""
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CRITICALKV_KERNEL", raising=False)
    build.forget()
    return tmp_path / "kernels"
