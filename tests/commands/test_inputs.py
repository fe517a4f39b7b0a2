"""Hostile inputs on the generate / demo / bench / eval side: a sentence before any work, never a
traceback or a silently wrong run (docs/reliability-inputs.md lists each case).

Tiny random models saved to a folder stand in for a real one (``--model FOLDER``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

import criticalkv as ckv
from criticalkv.bench.runner import BenchConfig, load_records, run_bench
from criticalkv.cli import main
from criticalkv.commands.bench import SPELLING
from criticalkv.eval import demo as demo_module
from criticalkv.eval.sweep import SweepConfig, head_scores_fingerprint
from criticalkv.options import OptionError
from tests.conftest import make_tiny
from tests.helpers.synthetic_scores import synthetic_head_scores
from tests.helpers.tiny_tokenizer import char_tokenizer

LIMIT = 1024  # the tiny models' max_position_embeddings


@pytest.fixture(scope="module")
def scores_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_head_scores(make_tiny("llama")).save(tmp_path_factory.mktemp("scores") / "scores.json")


@pytest.fixture(scope="module")
def other_scores_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head scores of another architecture (2 layers, not 3)."""
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    return synthetic_head_scores(config).save(tmp_path_factory.mktemp("other") / "other.json")


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# --- files given to generate --------------------------------------------------------------------


def test_a_context_file_that_is_not_utf8_names_the_file_and_the_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    latin = tmp_path / "latin.txt"
    latin.write_bytes("first line\ncaf\xe9 context".encode("latin-1"))
    assert main(["generate", "--context-file", str(latin), "--question", "q?"]) == 2
    err = _error(capsys)
    assert f"--context-file {latin} is not UTF-8 text: byte 0xe9 at offset 14 (line 2)" in err
    assert "iconv" in err


def test_a_folder_given_as_the_context_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--context-file", str(tmp_path), "--question", "q?"]) == 2
    assert f"--context-file {tmp_path} is a folder" in _error(capsys)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.mkdir(), "is a folder"),
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text("{not json"), "could not read head scores"),
    ],
)
def test_bad_head_score_files_are_refused_before_the_model_loads(
    tmp_path: Path, make: object, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = tmp_path / "c.txt"
    ctx.write_text("some context")
    path = tmp_path / "scores.json"
    make(path)  # type: ignore[operator]
    argv = ["generate", "--model", str(tmp_path / "no-model"), "--context-file", str(ctx), "--question", "q?"]
    assert main([*argv, "--head-scores", str(path)]) == 2  # the model folder does not exist: never reached
    assert message in _error(capsys)


# --- output folders -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["demo"], ["bench", "--kvpress", "off"]])
def test_an_output_folder_that_is_a_file(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "results"
    a_file.write_text("x")
    missing_model = ["--model", str(tmp_path / "no-model")]  # refused before the model is looked up
    assert main([*command, *missing_model, "--out", str(a_file)]) == 2
    assert f"--out {a_file} is a file, not a folder" in _error(capsys)
    assert main([*command, *missing_model, "--out", str(a_file / "inside")]) == 2
    assert f"{a_file} is a file, so the folder cannot be created inside it" in _error(capsys)


# --- contexts longer than the model takes ---------------------------------------------------------


def test_generate_refuses_a_context_beyond_the_model_before_running_it() -> None:
    model = ckv.attach(make_tiny("llama"))
    forwards = []
    handle = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(
            ValueError, match=r"has 12\d\d tokens plus 32 new tokens: 12\d\d positions, more than the 1024"
        ):
            ckv.generate(model, char_tokenizer(), "x" * 1200, "why?", chat=False)
    finally:
        handle.remove()
    assert forwards == []


def test_generate_command_refuses_a_long_context(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = tmp_path / "long.txt"
    ctx.write_text("y" * 2000)
    argv = ["generate", "--model", str(tiny_folder), "--context-file", str(ctx), "--question", "q?", "--no-chat"]
    assert main(argv) == 2
    err = _error(capsys)
    assert re.search(r"has 20\d\d tokens plus 32 new tokens", err) and "config.max_position_embeddings" in err
    assert "shorten the context" in err


def test_demo_refuses_a_length_beyond_the_model_before_making_samples(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a sample was made")

    monkeypatch.setattr(demo_module, "make_needle_sample", never)
    argv = ["demo", "--model", str(tiny_folder), "--length", "100000", "--out", str(tmp_path / "d")]
    assert main(argv) == 2
    err = _error(capsys)
    assert "--length 100000 has 100000 tokens plus 32 new tokens" in err and "lower --length" in err
    assert not (tmp_path / "d").exists()


def test_the_runtime_prefill_refuses_too_many_positions() -> None:
    model = ckv.attach(make_tiny("llama"))
    ids = torch.ones(1, LIMIT + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="1025 tokens: 1025 positions, more than the 1024"):
        ckv.runtime.prefill(model, ids, torch.ones_like(ids), window=8)


# --- bench budgets ------------------------------------------------------------------------------


def test_bench_takes_a_token_count_budget() -> None:
    tiny = ckv.attach(make_tiny("llama"))
    config = BenchConfig(
        context_lengths=[160], methods=["snapkv"], budgets=[64], decode_tokens=2, window=8, kvpress="off"
    )
    records = run_bench(config, tiny, char_tokenizer())
    compressed = [r for r in records if r.method == "snapkv"]
    assert [r.budget for r in compressed] == [64.0]
    # 64 of 160 entries per head: the bytes held are 64/160 of the full cache's (nothing else evicted)
    assert compressed[0].kv_bytes == pytest.approx(compressed[0].kv_bytes_full * 64 / 160, rel=0.01)


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ([512], "--budgets 512 at --context-lengths 160: the prompt has 160 tokens: budget 512 tokens exceeds the"),
        ([4], "--budgets 4 at --context-lengths 160: the prompt has 160 tokens: the budget (4 tokens per head) is"),
        ([0.01], "--budgets 0.01 at --context-lengths 160: the prompt has 160 tokens: the budget (1 tokens per head)"),
    ],
)
def test_bench_refuses_budgets_that_cannot_run_before_measuring(budgets: list[float], message: str) -> None:
    with pytest.raises(ValueError) as err:
        BenchConfig(context_lengths=[160], methods=["snapkv"], budgets=budgets, window=8, kvpress="off")
    assert isinstance(err.value, OptionError) and message in err.value.spelled(SPELLING)


def test_bench_command_with_a_token_count(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--model", str(tiny_folder), "--context-lengths", "160", "--methods", "snapkv", "--budgets", "64"]
    argv += ["--decode-tokens", "2", "--window", "8", "--kvpress", "off", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert [r["budget"] for r in load_records(tmp_path / "records.jsonl")] == [1.0, 64.0]
    capsys.readouterr()
    assert main(argv) == 0  # resumes: nothing measured again
    assert len(load_records(tmp_path / "records.jsonl")) == 2
    assert main([*argv[:-2], "--out", str(tmp_path / "b"), "--budgets", "2000"]) == 2
    assert "exceeds the context length" in _error(capsys)
    assert not (tmp_path / "b").exists()


# --- --head-scores ------------------------------------------------------------------------------


def test_bench_head_scores_bind_and_a_foreign_file_is_refused(
    tiny_folder: Path, scores_file: Path, other_scores_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--model", str(tiny_folder), "--context-lengths", "160", "--methods", "headkv"]
    argv += ["--budgets", "0.3", "--decode-tokens", "2", "--window", "8", "--kvpress", "off", "--json"]
    assert main([*argv, "--head-scores", str(scores_file)]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in records] == ["full", "headkv"]
    assert main([*argv, "--head-scores", str(other_scores_file)]) == 2
    err = _error(capsys)
    assert f"the head scores in {other_scores_file}" in err and "criticalkv head-scores" in err


def test_generate_with_head_scores(
    tiny_folder: Path, scores_file: Path, other_scores_file: Path, tmp_path: Path
) -> None:
    model, tokenizer = ckv.load_model(tiny_folder)
    context = "the quick brown fox jumps over the lazy dog " * 4
    result = ckv.generate(
        model, tokenizer, context, "who?", method="headkv", head_scores=scores_file, chat=False, window=8
    )
    assert result.method == "headkv" and result.kv_bytes < result.kv_bytes_full
    with pytest.raises(ValueError, match="head scores"):
        ckv.generate(model, tokenizer, context, "who?", method="headkv", head_scores=other_scores_file, chat=False)
    ctx = tmp_path / "c.txt"
    ctx.write_text(context)
    argv = ["generate", "--model", str(tiny_folder), "--context-file", str(ctx), "--question", "who?", "--no-chat"]
    argv += ["--method", "headkv", "--window", "8", "--max-new-tokens", "3", "--json"]
    assert main([*argv, "--head-scores", str(scores_file)]) == 0


def test_eval_identity_holds_the_head_score_file_content(scores_file: Path, tmp_path: Path) -> None:
    base = dict(out=tmp_path / "r", tasks=["niah_single_1"], lengths=[200], methods=["full", "headkv"], window=8)
    plain = SweepConfig(**base)  # type: ignore[arg-type]
    assert "head_scores" not in plain.identity() and "head_scores" not in plain.to_json()
    with_file = SweepConfig(**base, head_scores=str(scores_file))  # type: ignore[arg-type]
    assert with_file.identity() == {**plain.identity(), "head_scores": head_scores_fingerprint(str(scores_file))}
    assert with_file.to_json()["head_scores"] == str(scores_file)
    copy = tmp_path / "copy.json"
    copy.write_bytes(scores_file.read_bytes())  # the same content by another path: the same run
    assert SweepConfig(**base, head_scores=str(copy)).identity() == with_file.identity()  # type: ignore[arg-type]
    edited = json.loads(scores_file.read_text())
    edited["model"] = "edited"
    copy.write_text(json.dumps(edited))
    assert SweepConfig(**base, head_scores=str(copy)).identity() != with_file.identity()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not exist"):
        SweepConfig(**base, head_scores=str(tmp_path / "missing.json"))  # type: ignore[arg-type]


def test_eval_command_sweeps_with_a_head_score_file(
    tiny_folder: Path, scores_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["eval", "--model", str(tiny_folder), "--tasks", "niah_single_1", "--lengths", "600", "--samples", "1"]
    argv += ["--methods", "full,headkv", "--budgets", "0.5", "--window", "8", "--max-new-tokens", "2", "--no-chat"]
    assert main([*argv, "--head-scores", str(scores_file), "--out", str(out)]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["identity"]["head_scores"] == head_scores_fingerprint(str(scores_file))
    lines = (out / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["method"] for line in lines) == ["full", "headkv"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "99999"], "--port must be a TCP port between 0 and 65535, not 99999"),
        (["serve", "--memory-cap", "inf"], "--memory-cap must be a finite positive number of MiB, not inf"),
        (["serve", "--memory-cap", "nan"], "--memory-cap must be a finite positive number of MiB, not nan"),
        (
            ["generate", "--context-file", "README.md", "--question", "q", "--kv-group-size", "8"],
            "give --kv-bits 8 or 4 too",
        ),
    ],
)
def test_options_out_of_range_are_a_sentence_before_any_work(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 30, cases 7 and 9: `--port 99999` loaded the model and listened nowhere, `--memory-cap inf`
    was an OverflowError traceback and `nan` "cannot convert float NaN to integer", and `generate
    --kv-group-size` without `--kv-bits` ran and ignored it."""
    assert main([*argv[:1], "--model", "/nonexistent/model", *argv[1:]]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "--model", "/nonexistent/model", "--out", "{folder}/run"],
        ["perturbation", "--model", "/nonexistent/model", "--out", "{folder}/run"],
        ["head-scores", "--model", "/nonexistent/model", "--out", "{folder}/scores.json"],
        ["serve", "--model", "/nonexistent/model", "--store", "{folder}/store"],
        ["report", "{folder}"],
    ],
    ids=["eval", "perturbation", "head-scores", "serve", "report"],
)
def test_an_unwritable_folder_is_a_sentence_before_the_model_loads(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 30, case 6: `eval --out` on a read-only filesystem, `report` on a read-only folder and
    `serve --store` on a read-only mount ended in OSError tracebacks (eval's after the model
    loaded). Every command that writes now checks its folder first (simulated: this test may run
    as root, for whom permissions do not bind, so the folder is made to look unwritable)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == folder else real_access(p, mode))
    assert main([part.replace("{folder}", str(folder)) for part in command]) == 2
    err = capsys.readouterr().err
    assert f"{folder} is not writable; choose another folder" in err and "Traceback" not in err
