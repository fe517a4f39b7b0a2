"""A bench ``--out`` folder records what its records were measured on and refuses another setup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from criticalkv.bench import BenchConfig, run_bench
from criticalkv.cli import main
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer


def _config(**changes: object) -> BenchConfig:
    base: dict[str, object] = dict(
        context_lengths=[96], methods=["snapkv"], budgets=[0.25], decode_tokens=2, window=8, kvpress="off"
    )
    base.update(changes)
    return BenchConfig(**base)  # type: ignore[arg-type]


def test_run_json_holds_the_identity_and_every_runs_provenance(tmp_path: Path) -> None:
    model = make_tiny("llama")
    run_bench(_config(), model, char_tokenizer(), out=tmp_path)
    run_bench(_config(methods=["snapkv", "knorm"]), model, char_tokenizer(), out=tmp_path)  # more methods: resumes
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["identity"]["window"] == 8 and run["identity"]["decode_tokens"] == 2
    assert run["identity"]["device"] == "cpu" and run["identity"]["torch"] and run["identity"]["kvpress"] is None
    assert [entry["config"]["methods"] for entry in run["runs"]] == [["snapkv"], ["snapkv", "knorm"]]
    assert all("git_commit" in entry and "python" in entry for entry in run["runs"])
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 3  # full, snapkv, knorm


@pytest.mark.parametrize(
    ("changes", "model_kind", "named"),
    [
        ({"window": 16}, "llama", "window: 8 there, 16 now"),
        ({"decode_tokens": 4}, "llama", "decode_tokens: 2 there, 4 now"),
        ({"repeats": 3}, "llama", "repeats: 1 there, 3 now"),
        ({}, "mistral", "model: "),
    ],
)
def test_a_resume_with_another_setup_is_refused_before_any_record(
    tmp_path: Path, changes: dict[str, object], model_kind: str, named: str
) -> None:
    run_bench(_config(), make_tiny("llama"), char_tokenizer(), out=tmp_path)
    before = (tmp_path / "records.jsonl").read_text()
    with pytest.raises(ValueError, match="holds bench records of a different setup") as err:
        run_bench(_config(methods=["knorm"], **changes), make_tiny(model_kind), char_tokenizer(), out=tmp_path)
    assert named in str(err.value) and "use another --out" in str(err.value)
    assert (tmp_path / "records.jsonl").read_text() == before


def test_the_cli_answers_a_mismatch_with_a_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "tiny"
    make_tiny("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    argv = ["bench", "--model", str(folder), "--context-lengths", "96", "--methods", "snapkv", "--window", "8",
            "--kvpress", "off", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main([*argv, "--decode-tokens", "2"]) == 0
    capsys.readouterr()
    assert main([*argv, "--decode-tokens", "3"]) == 2
    assert "decode_tokens: 2 there, 3 now" in capsys.readouterr().err


def test_a_second_writer_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    from criticalkv.runs import FolderBusy, writer_lock

    with writer_lock(tmp_path), pytest.raises(FolderBusy, match=f"is writing to {tmp_path}") as err:
        run_bench(_config(), make_tiny("llama"), char_tokenizer(), out=tmp_path)
    assert "--wait" not in str(err.value) and "use another --out" in str(err.value)
    assert not (tmp_path / "records.jsonl").exists() and not (tmp_path / "run.json").exists()
