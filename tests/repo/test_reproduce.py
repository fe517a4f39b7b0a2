"""``make reproduce`` writes to a fresh folder, says its run time before anything runs, and compares
the fresh claims with the committed ones (issue 42, point 14). The sweeps themselves (about 95
minutes) are not run here: the plan (``make -n``) and the comparison step are tested."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reproduce_compare", ROOT / "benchmarks" / "reproduce_compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


reproduce_compare = _load()
COMMITTED = ROOT / "docs" / "results"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_plan_says_its_time_first_and_writes_only_to_the_fresh_folder(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under `make test`
    plan = subprocess.run(
        ["make", "--no-print-directory", "-n", "reproduce", f"VENV={tmp_path / 'venv'}", f"REPRODUCE_OUT={fresh}"],
        cwd=ROOT, capture_output=True, text=True, check=True, env=env,
    ).stdout  # fmt: skip
    lines = plan.splitlines()
    assert lines[0].startswith("echo") and re.search(r"about \d+ minutes", lines[0])  # before the install
    assert any("pip install" in line for line in lines[1:])
    written = re.findall(r"--(?:out|doc) (\S+)", plan)
    assert len(written) == 6 and all(path.startswith(str(fresh)) for path in written)
    assert "docs/results" not in " ".join(written)
    assert lines[-1].endswith(f"reproduce_compare.py --fresh {fresh} --committed docs/results")


def test_the_committed_claims_table_parses() -> None:
    table = reproduce_compare.claims_table(COMMITTED / "claims.md")
    assert len(table) > 20
    assert all(row["verdict"] and row["measured"] for row in table.values())


def test_the_comparison_names_each_changed_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (COMMITTED / "claims.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if "| holds |" in line)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "claims.md").write_text(text.replace(row, row.replace("| holds |", "| does not hold |")))
    assert reproduce_compare.main(["--fresh", str(fresh), "--committed", str(COMMITTED)]) == 0
    out = capsys.readouterr().out
    assert out.count("VERDICT CHANGED: holds -> does not hold") == 1
    shared = len(reproduce_compare.claims_table(COMMITTED / "claims.md"))
    assert f"{shared - 1} of {shared} shared claims reach the committed verdict; 1 changed" in out


def test_a_missing_fresh_table_is_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert reproduce_compare.main(["--fresh", str(tmp_path), "--committed", str(COMMITTED)]) == 2
    assert "no claims table at" in capsys.readouterr().err
