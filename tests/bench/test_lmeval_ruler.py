"""benchmarks/lmeval_ruler.py: its command lines and its table, on tiny synthetic run folders."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def script() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "lmeval_ruler.py"
    spec = importlib.util.spec_from_file_location("lmeval_ruler_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(folder: Path, scores: list[float], ratio: float) -> None:
    (folder / "default").mkdir(parents=True)
    config = {"config": {"criticalkv": {"kv_ratio_mean": ratio}}}
    (folder / "default" / "results_2026.json").write_text(json.dumps(config))
    lines = [json.dumps({"doc_id": i, "1024": s}) for i, s in enumerate(scores)]
    (folder / "default" / "samples_niah_single_1_2026.jsonl").write_text("\n".join(lines) + "\n")


def test_the_table_has_both_harnesses_scores_intervals_and_counts(script: ModuleType, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _run(runs / "niah_single_1" / "snapkv", [1.0, 0.0, 1.0, 1.0], 0.199)
    harness = tmp_path / "results.jsonl"
    records = [
        {"task": "niah_single_1", "method": "snapkv", "length": 1024, "budget": 0.2, "score": 1.0},
        {"task": "niah_single_1", "method": "snapkv", "length": 1024, "budget": 0.2, "score": 0.0},
        {"task": "niah_single_1", "method": "snapkv", "length": 1024, "budget": 0.4, "score": 1.0},  # another budget
        {"task": "niah_single_1", "method": "snapkv", "length": 2048, "budget": 0.2, "score": 1.0},  # another length
    ]
    harness.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    table = script.report(runs, harness, 0.2).splitlines()
    assert len(table) == 3
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[:3] == ["niah_single_1", "snapkv", "75.0"]
    assert cells[4:6] == ["4", "0.199"]
    assert cells[6] == "50.0" and cells[8] == "2"
    low, high = (float(x) for x in cells[3].strip("[]").split(","))
    assert 0.0 <= low <= 75.0 <= high <= 100.0


def test_a_run_is_one_criticalkv_lm_eval_command(script: ModuleType, tmp_path: Path) -> None:
    line = script.command("niah_single_1", "snapkv", 0.2, 10, tmp_path, "/tok")
    assert line[:4] == ["criticalkv", "lm-eval", "--model", "criticalkv"]
    assert line[line.index("--model_args") + 1] == "pretrained=default,method=snapkv,budget=0.2"
    assert json.loads(line[line.index("--metadata") + 1]) == {"max_seq_lengths": [1024], "tokenizer": "/tok"}
    assert line[line.index("--use_cache") + 1] == str(tmp_path / "cache")
