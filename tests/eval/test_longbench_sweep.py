"""LongBench end to end: the sweep runner, resume, reports by bucket, and ``criticalkv eval``."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import criticalkv as ckv
from criticalkv.cli import main
from criticalkv.eval import results as sweep_results
from criticalkv.eval.longbench import tasks
from criticalkv.eval.report import build_report, summarise
from criticalkv.eval.sweep import SweepConfig, run_sweep
from tests.conftest import make_tiny
from tests.eval.test_longbench_data import FIXTURES, exact_char_tokenizer

TASKS = ["narrativeqa", "hotpotqa", "gov_report", "trec", "triviaqa", "passage_retrieval_en", "lcc", "repobench-p"]


@pytest.fixture(scope="module")
def tok() -> Any:
    return exact_char_tokenizer()


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return ckv.attach(make_tiny("llama"))


def _config(out: Path, **kw: Any) -> SweepConfig:
    base: dict[str, Any] = dict(
        out=out,
        benchmark="longbench",
        data_dir=str(FIXTURES),
        tasks=TASKS,
        lengths=[500],
        methods=["full", "snapkv", "critical-snapkv"],
        budgets=[0.3],
        samples=2,
        window=8,
        max_new_tokens=4,
        model="tiny",
    )
    base.update(kw)
    return SweepConfig(**base)


def test_longbench_sweep_writes_scores_and_resumes(tmp_path: Path, tok: Any, tiny: Any) -> None:
    out = tmp_path / "run"
    config = _config(out)
    run_sweep(config, tiny, tok)
    records = sweep_results.read_results(out)
    rows = {t: len(tasks_records) for t in TASKS if (tasks_records := [r for r in records if r["task"] == t])}
    assert set(rows) == set(TASKS) and rows["lcc"] == 2 * 3 and rows["trec"] == 2 * 3  # 2 samples x 3 configs
    for r in records:
        assert r["metric"] == tasks.METRIC[r["task"]] and 0.0 <= r["score"] <= 1.0
        assert r["length"] == 500 and r["prompt_tokens"] <= 500 + 2
        assert r["meta"]["dataset"] == r["task"] and "bucket" in r["meta"] and "_id" in r["meta"]
    trec = next(r for r in records if r["task"] == "trec")
    assert trec["meta"]["all_classes"] and trec["meta"]["first_line"]
    narrative = next(r for r in records if r["task"] == "narrativeqa")
    assert narrative["meta"]["truncated_tokens"] > 0  # its story is longer than 500 characters
    run_sweep(config, tiny, tok)  # resume: nothing left to do
    assert len(sweep_results.read_results(out)) == len(records)
    run = json.loads((out / "run.json").read_text())
    assert run["identity"]["benchmark"] == "longbench" and run["identity"]["data_dir"] == str(FIXTURES.resolve())
    with pytest.raises(ValueError, match="different configuration"):
        run_sweep(_config(out, max_new_tokens=8), tiny, tok)
    text, plots = build_report(out)
    assert "passage_retrieval_en" in text and "critical-snapkv" in text and all(p.exists() for p in plots)


def test_question_agnostic_longbench(tmp_path: Path, tok: Any, tiny: Any) -> None:
    out = tmp_path / "run"
    run_sweep(_config(out, mode="question-agnostic", tasks=["qasper", "samsum"], samples=1), tiny, tok)
    records = sweep_results.read_results(out)
    assert len(records) == 2 * 3 and all(r["prompt_tokens"] == r["context_tokens"] for r in records)


def test_longbench_e_report_groups_by_bucket(tmp_path: Path, tok: Any, tiny: Any) -> None:
    out = tmp_path / "run"
    run_sweep(_config(out, tasks=["hotpotqa", "passage_count"], longbench_e=True, samples=3), tiny, tok)
    records = sweep_results.read_results(out)
    assert sorted({r["meta"]["bucket"] for r in records}) == ["0-4k", "4-8k", "8k+"]
    text, _ = build_report(out, buckets=True)
    for bucket in ("0-4k", "4-8k", "8k+"):
        assert f"[LongBench-E bucket {bucket}]" in text
    with (out / "summary_buckets.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["bucket"] for r in rows} == {"all", "0-4k", "4-8k", "8k+"}
    full = [r for r in rows if r["method"] == "full" and r["task"] == "average" and r["bucket"] == "8k+"]
    assert len(full) == 1 and full[0]["n"] == "2"  # one sample per dataset in that bucket
    assert main(["report", str(out), "--buckets"]) == 0
    ruler_like = {**records[0], "task": "vt", "meta": {}}
    with pytest.raises(ValueError, match="needs LongBench results"):
        summarise([ruler_like], by="bucket")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    make_tiny("llama").save_pretrained(path)
    exact_char_tokenizer().save_pretrained(path)
    return path


def test_cli_longbench_on_the_fixtures(tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    args = ["eval", "--benchmark", "longbench", "--data-dir", str(FIXTURES), "--tasks", "trec,hotpotqa,lcc"]
    args += ["--model", str(folder), "--lengths", "400", "--methods", "full,critical-adakv", "--budgets", "0.3"]
    args += ["--samples", "1", "--window", "8", "--max-new-tokens", "4", "--out", str(out), "--device", "cpu"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "hotpotqa" in printed and "critical-adakv" in printed
    assert {r["task"] for r in sweep_results.read_results(out)} == {"trec", "hotpotqa", "lcc"}
    assert main([*args[:5], "--tasks", "narrativeqa", *args[7:], "--longbench-e"]) == 2  # not in LongBench-E
    assert "unknown LongBench-E task" in capsys.readouterr().err
    missing = ["eval", "--benchmark", "longbench", "--data-dir", str(tmp_path), "--tasks", "qasper"]
    assert main([*missing, "--model", str(folder), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "data.zip" in err and "--data-dir" in err


@pytest.mark.slow
def test_cli_longbench_on_the_default_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real tokenizer and chat template: a chat dataset and a raw (no-chat) one."""
    out = tmp_path / "default"
    args = ["eval", "--benchmark", "longbench", "--data-dir", str(FIXTURES), "--tasks", "hotpotqa,triviaqa"]
    args += ["--model", "default", "--lengths", "1024", "--methods", "full,critical-snapkv", "--budgets", "0.5"]
    args += ["--samples", "1", "--window", "16", "--out", str(out)]
    assert main(args) == 0
    records = sweep_results.read_results(out)
    assert len(records) == 4
    full = {r["task"]: r for r in records if r["method"] == "full"}
    # the answer is in the passages; the 135M model answers in a sentence, which F1 scores below 1
    assert "Aarhus" in full["hotpotqa"]["prediction"] and full["hotpotqa"]["score"] > 0
    assert full["triviaqa"]["new_tokens"] <= tasks.MAX_NEW_TOKENS["triviaqa"]
