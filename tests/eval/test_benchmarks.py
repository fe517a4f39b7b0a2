"""The benchmark registry: each benchmark's own options, checks and part of the run identity."""

from __future__ import annotations

from pathlib import Path

import pytest

from criticalkv.eval.benchmarks import BENCHMARKS, DatasetOptions, LongBenchOptions, RulerOptions, get_benchmark
from criticalkv.eval.sweep import SweepConfig
from criticalkv.eval.tasks import TASK_NAMES


def test_the_registry_holds_the_three_benchmarks() -> None:
    assert list(BENCHMARKS) == ["ruler", "longbench", "dataset"]
    assert get_benchmark("ruler").options_type is RulerOptions
    with pytest.raises(ValueError, match="'ruler', 'longbench' or 'dataset'"):
        get_benchmark("nope")


def test_options_or_flat_arguments_make_the_same_config(tmp_path: Path) -> None:
    flat = SweepConfig(out=tmp_path, tasks=["qa_1"], qa_source="squad.json")
    own = SweepConfig(out=tmp_path, tasks=["qa_1"], options=RulerOptions(qa_source="squad.json"))
    assert flat.options == own.options == RulerOptions("squad.json")
    assert flat.identity() == own.identity() and flat.to_json() == own.to_json()
    assert SweepConfig(out=tmp_path).tasks == list(TASK_NAMES)
    with pytest.raises(AttributeError):
        flat.qa_source  # noqa: B018 (the flat spelling is an argument only)


def test_each_benchmark_refuses_the_options_of_another(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--qa-source is a RULER option"):
        SweepConfig(out=tmp_path, benchmark="dataset", dataset="d.jsonl", qa_source="squad.json")
    with pytest.raises(ValueError, match="--dataset selects the dataset benchmark"):
        SweepConfig(out=tmp_path, dataset="d.jsonl")
    with pytest.raises(ValueError, match="takes LongBenchOptions"):
        SweepConfig(out=tmp_path, benchmark="longbench", options=RulerOptions())
    with pytest.raises(ValueError, match="not both"):
        SweepConfig(out=tmp_path, options=RulerOptions(), qa_source="squad.json")
    with pytest.raises(ValueError, match="needs --dataset"):
        SweepConfig(out=tmp_path, benchmark="dataset", options=DatasetOptions())


def test_the_identity_names_every_benchmarks_legacy_keys(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"context": "c", "question": "q", "answers": ["a"]}\n')
    config = SweepConfig(out=tmp_path, benchmark="dataset", dataset=str(data))
    # the file's name, not its path (its lines are identified by content, see test_run_reliability.py)
    assert config.identity()["dataset"] == "d.jsonl" and config.identity()["qa_source"] is None
    assert config.to_json()["dataset"] == str(data)
    assert "data_dir" not in config.identity() and config.tasks == []
    assert config.to_json()["data_dir"] is None and config.to_json()["longbench_e"] is False
    assert LongBenchOptions().longbench_e is False
