"""docs/contributing.md's benchmark worked example, followed literally on a copy of the tree: the new
benchmark's file and its registration (2 files), then a sweep of it on a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import guide

GUIDE = guide.GUIDE
ACTIONS = ("benchmark file", "benchmark import in", "benchmark registration appended to")

#: run in the copy: the CLI accepts the new name, and a sweep of it records its option
SCRIPT = """
import json, sys
from pathlib import Path

import criticalkv as ckv
from criticalkv.cli import build_parser
from criticalkv.eval import results as sweep_results
from criticalkv.eval.benchmarks.needle_depth import NeedleDepthOptions
from criticalkv.eval.sweep import SweepConfig, run_sweep
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer

out = Path(sys.argv[1])
args = build_parser().parse_args(["eval", "--benchmark", "needle-depth", "--out", str(out)])
config = SweepConfig(
    out=out, benchmark=args.benchmark, options=NeedleDepthOptions(depth=0.25), lengths=[160], samples=2,
    methods=["full", "snapkv"], budgets=[0.5], max_new_tokens=4,
)
run_sweep(config, ckv.attach(make_tiny("llama")), char_tokenizer())
records = sweep_results.read_results(out)
rows = [[r["task"], r["length"], r["index"], r["method"]] for r in records]
print(json.dumps({"records": rows, "identity": config.identity(), "run_json": (out / sweep_results.RUN).read_text()}))
"""


def guide_steps() -> list[tuple[str, str, str]]:
    """``(action, path, code)`` of every code block of the benchmark example."""
    return guide.guide_steps(ACTIONS)


def follow(steps: list[tuple[str, str, str]], tree: Path) -> None:
    guide.follow(steps, tree, new=ACTIONS[0], append=ACTIONS[2], gap="\n")


def test_a_new_benchmark_is_two_files() -> None:
    steps = guide_steps()
    assert [action for action, _, _ in steps] == list(ACTIONS)
    assert len({path for _, path, _ in steps}) == 2
    assert "**2 files**" in GUIDE.read_text()


@pytest.mark.slow
def test_the_benchmark_example_runs_a_sweep(tmp_path: Path) -> None:
    tree = guide.copy_tree(tmp_path / "tree", ("src", "tests"))
    follow(guide_steps(), tree)
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}"}
    command = [sys.executable, "-c", SCRIPT, str(tmp_path / "run")]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(map(tuple, result["records"])) == [("needle", 160, i, m) for i in (0, 1) for m in ("full", "snapkv")]
    assert result["identity"]["benchmark"] == "needle-depth" and result["identity"]["depth"] == 0.25
    assert '"depth": 0.25' in result["run_json"]  # run.json records the option


def test_the_cli_offers_the_registered_benchmarks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from criticalkv.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--benchmark", "needle-depth", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'needle-depth' (choose from 'ruler', 'longbench';" in err
