"""``--samples`` is per task for ``--dataset`` files: every task runs, and the CLI says how many
lines of each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import criticalkv as ckv
from criticalkv.eval import results as sweep_results
from criticalkv.eval.sweep import SweepConfig, run_sweep
from criticalkv.eval.tasks import describe_usage, first_per_task, load_dataset_file
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer


def _write(path: Path, per_task: dict[str, int]) -> Path:
    filler = "The grass is green. " * 12
    lines = []
    for task, count in per_task.items():
        for i in range(count):
            row = {"context": filler + f"The code is {i}.", "question": "Code?", "answers": [str(i)], "task": task}
            lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_first_per_task_keeps_every_task_sample_major(tmp_path: Path) -> None:
    samples = load_dataset_file(_write(tmp_path / "d.jsonl", {"a": 20, "b": 20, "c": 20}))
    chosen, usage = first_per_task(samples, 10)
    assert usage == {"a": (10, 20), "b": (10, 20), "c": (10, 20)}
    assert [s.task for s in chosen[:6]] == ["a", "b", "c", "a", "b", "c"]
    assert [s.index for s in chosen if s.task == "b"] == list(range(21, 31))  # its first 10 lines (1-based), in order
    few, usage = first_per_task(load_dataset_file(_write(tmp_path / "e.jsonl", {"a": 2, "b": 5})), 3)
    assert usage == {"a": (2, 2), "b": (3, 5)} and len(few) == 5
    line = describe_usage("e.jsonl", usage)
    assert line == "e.jsonl: lines used per task (--samples is per task): a 2 of 2, b 3 of 5"
    with pytest.raises(ValueError, match="per task"):
        first_per_task(samples, 0)


def test_dataset_sweep_runs_samples_per_task(tmp_path: Path) -> None:
    data = _write(tmp_path / "d.jsonl", {"a": 3, "b": 3, "c": 3})
    out = tmp_path / "run"
    config = SweepConfig(
        out=out,
        benchmark="dataset",
        dataset=str(data),
        tasks=[],
        lengths=[600],
        methods=["full", "snapkv"],
        budgets=[0.5],
        samples=2,
        window=8,
        max_new_tokens=2,
        model="tiny",
    )
    run_sweep(config, ckv.attach(make_tiny("llama")), char_tokenizer())
    records = sweep_results.read_results(out)
    per_task = {t: sorted({r["index"] for r in records if r["task"] == t}) for t in "abc"}
    assert per_task == {"a": [1, 2], "b": [4, 5], "c": [7, 8]}
    assert len(records) == 3 * 2 * 2


def test_a_dataset_file_is_evaluated_whole_unless_samples_says_otherwise(tmp_path: Path) -> None:
    """Issue 29, point 9: a 60-line file of 20 lines per task runs all 60 lines by default."""
    from criticalkv.cli import build_parser

    data = _write(tmp_path / "d.jsonl", {"a": 20, "b": 20, "c": 20})
    chosen, usage = first_per_task(load_dataset_file(data), None)
    assert len(chosen) == 60 and usage == {"a": (20, 20), "b": (20, 20), "c": (20, 20)}
    args = build_parser().parse_args(["eval", "--dataset", str(data), "--out", str(tmp_path / "run")])
    assert args.samples is None
    whole = SweepConfig(out=tmp_path / "run", benchmark="dataset", dataset=str(data), tasks=[], samples=args.samples)
    assert whole.draw.samples is None
    assert SweepConfig(out=tmp_path / "r", samples=None).draw.samples == 10  # RULER's default
    assert SweepConfig(out=tmp_path / "r", benchmark="dataset", dataset=str(data), samples=4).draw.samples == 4
