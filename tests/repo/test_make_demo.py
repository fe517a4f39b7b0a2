"""``make demo`` installs only what the demo needs, and says so while it does (issue 29, point 4)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_installs_the_demo_extra_visibly(tmp_path: Path) -> None:
    venv = tmp_path / "venv"  # does not exist: make plans every step of a fresh set-up
    plan = subprocess.run(["make", "-n", "demo", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True)
    installs = [line for line in plan.stdout.splitlines() if "pip install" in line]
    assert any('-e ".[demo]"' in line for line in installs), plan.stdout
    assert not any("[dev]" in line or "--quiet" in line or " -q " in line for line in installs), plan.stdout
    assert "echo" in plan.stdout  # it says what it is doing
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert all(not req.startswith(("ray", "pytest", "mypy", "ruff", "fastapi")) for req in extras["demo"])
