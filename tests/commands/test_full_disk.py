"""A full disk (ENOSPC, simulated: each write creates its file, then fails) under ``report``,
``bench --out`` and ``head-scores --out`` (issue 41): one sentence naming the file, exit 2, no
traceback, and no empty or partial file left (``report`` left a 0-byte PNG)."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

import criticalkv as ckv
from criticalkv.cli import main
from criticalkv.eval.sweep import run_sweep
from tests.conftest import make_tiny
from tests.eval.test_eval import _config
from tests.helpers.tiny_tokenizer import char_tokenizer
from tests.methods.test_head_scores import tiny_llama, word_tokenizer

NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _failing(write: Callable[..., Any]) -> Callable[..., Any]:
    """``write`` that creates its file (empty) and then finds the disk full."""

    def full(*args: Any, **kwargs: Any) -> Any:
        target = next(a for a in args if isinstance(a, (str, Path)))
        Path(target).write_bytes(b"")
        raise OSError(NO_SPACE.errno, NO_SPACE.strerror)

    return full


def _leftovers(folder: Path) -> list[str]:
    """Empty files and partial temporaries anywhere under ``folder`` (the writer lock is empty by design)."""
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and p.name != "writer.lock" and (".partial" in p.name or not p.stat().st_size)
    )


def _one_sentence(err: str, name: str) -> None:
    assert "No space left on device" in err and name in err and "free some space" in err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if "error" in line] == [err.strip().splitlines()[-1]]
    assert err.strip().splitlines()[-1].startswith("criticalkv: error: could not write ")


def test_report_on_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    run_sweep(_config(out, tasks=["niah_single_1"], samples=1), ckv.attach(make_tiny("llama")), char_tokenizer())
    capsys.readouterr()  # the sweep's progress
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: _failing(lambda p: None)(path))
    assert main(["report", str(out)]) == 2
    _one_sentence(capsys.readouterr().err, "score_vs_budget.png")
    assert _leftovers(out) == [] and not (out / "score_vs_budget.png").exists()


def test_bench_out_on_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "tiny-model"
    make_tiny("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    real = Path.write_text

    def write_text(self: Path, *args: Any, **kwargs: Any) -> int:
        if self.name.endswith(".json") and "results" in self.name:
            _failing(lambda p: None)(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    out = tmp_path / "bench"
    argv = ["bench", "--model", str(folder), "--context-lengths", "96", "--methods", "snapkv", "--budgets", "0.25"]
    argv += ["--decode-tokens", "2", "--window", "8", "--kvpress", "off", "--out", str(out)]
    assert main(argv) == 2
    _one_sentence(capsys.readouterr().err, "results.json")
    assert _leftovers(out) == [] and not (out / "results.json").exists()
    assert (out / "records.jsonl").is_file()  # the measurements are kept: `bench --out` resumes from them


def test_head_scores_out_on_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "tiny-model"
    tiny_llama().save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    real = json.dump

    def dump(data: Any, handle: Any, **kwargs: Any) -> None:
        real(data, handle, **kwargs)
        handle.flush()
        raise OSError(NO_SPACE.errno, NO_SPACE.strerror)

    monkeypatch.setattr(json, "dump", dump)
    out = tmp_path / "out" / "scores.json"
    argv = ["head-scores", "--model", str(folder), "--out", str(out), "--lengths", "80", "--depths", "2"]
    assert main([*argv, "--min-accuracy", "0", "--no-cache"]) == 2
    _one_sentence(capsys.readouterr().err, "scores.json")
    assert not out.exists() and _leftovers(out.parent) == []
