"""Issue 42, point 12: ``criticalkv report`` reads lm-eval's ``samples_*.jsonl`` and compares runs
paired per document, with intervals, as it does our sweeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from criticalkv.cli import main
from criticalkv.eval.report import find_runs, format_lmeval_report, is_lmeval_folder

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "docs" / "results" / "lm-eval" / "runs"
DATE = "2026-12-06T10-00-00.000000"


def _run(folder: Path, method: str, scores: list[float], budget: float = 0.2) -> Path:
    """An lm-eval output folder as ``--output_path folder --log_samples`` leaves it (RULER's shape:
    the length asked for, 1024, and the default 4096 at -1 on every document)."""
    run = folder / "default"
    run.mkdir(parents=True)
    config = {"criticalkv": {"method": method, "budget": budget, "kv_ratio_mean": 1.0 if method == "full" else 0.2}}
    (run / f"results_{DATE}.json").write_text(json.dumps({"results": {}, "config": config}))
    lines = [{"doc_id": i, "metrics": ["4096", "1024"], "4096": -1.0, "1024": s} for i, s in enumerate(scores)]
    (run / f"samples_niah_x_{DATE}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


def test_runs_pair_per_document_against_full_and_the_base(tmp_path: Path) -> None:
    full = _run(tmp_path / "full", "full", [1.0] * 8 + [0.0] * 2)
    snap = _run(tmp_path / "snapkv", "snapkv", [0.0, 0.0] + [1.0] * 6 + [1.0, 0.0])
    crit = _run(tmp_path / "critical-snapkv", "critical-snapkv", [1.0] * 10)
    assert all(is_lmeval_folder(f) for f in (full, snap, crit)) and not is_lmeval_folder(tmp_path / "full" / "x")
    text = format_lmeval_report(find_runs([full, snap, crit]))
    against = text[text.index("against the full cache") :].splitlines()
    snap_line = next(line for line in against if line.lstrip().startswith("snapkv"))
    assert "score -10.0 pts" in snap_line and "n=10 paired documents (1 scored higher, 2 lower)" in snap_line
    crit_line = text[text.index("CriticalKV minus its base") :].splitlines()[1]
    assert (
        "critical-snapkv" in crit_line and "score +30.0 pts" in crit_line and "(3 scored higher, 0 lower)" in crit_line
    )
    assert "not measured (-1 on every document" in text and "niah_x [4096]" in text
    assert "niah_x [1024]" in text.splitlines()[0]


def test_the_cli_reports_the_committed_lm_eval_runs(capsys: pytest.CaptureFixture[str]) -> None:
    folders = [str(RUNS / "niah_single_1"), str(RUNS / "niah_multikey_2")]
    assert main(["report", *folders]) == 0
    out = capsys.readouterr().out
    assert "against the full cache (paired per document, bootstrap 95% CI):" in out
    assert "n=20 paired documents" in out  # 10 documents of each task, joined per method
    assert "niah_single_1 [4096]" in out  # the row lm-eval prints as `4096 ↑ -1.0 N/A`, named as not measured


def test_one_run_alone_says_what_to_add(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(RUNS / "niah_single_1" / "snapkv")]) == 0
    assert "no full-cache run among these folders" in capsys.readouterr().out


def test_a_sweep_and_lm_eval_folders_are_not_mixed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text("")
    assert main(["report", str(sweep), str(RUNS / "niah_single_1")]) == 2
    assert "not both" in capsys.readouterr().err
