"""The default model's cache in a folder of each test's own: a stand-in GGUF file and a GGUF reader
that returns a tiny Llama (``tests/models/test_models.py``), for the cache, staging and error tests."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from criticalkv.models import default_model as ckv_default_model
from criticalkv.models import gguf as ckv_gguf
from tests.models.test_models import _tiny_llama, _word_tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache folder with a stand-in GGUF file whose checksum is taken as the right one."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(folder))
    monkeypatch.delenv("CRITICALKV_VERIFY_CACHE", raising=False)
    monkeypatch.setattr(ckv_gguf, "installed_gguf", lambda: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systemp"))  # the "system temp folder"
    (tmp_path / "systemp").mkdir()
    (folder / "gguf").mkdir(parents=True)
    (folder / "gguf" / GGUF_NAME).write_bytes(b"stand-in")
    monkeypatch.setattr(ckv_gguf, "GGUF_SHA256", hashlib.sha256(b"stand-in").hexdigest())
    return folder


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch, cache: Path) -> list[bytes]:
    """A GGUF reader returning a tiny Llama; records the GGUF bytes of each conversion."""
    calls: list[bytes] = []

    def fake_load(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
        calls.append(path.read_bytes())
        return _tiny_llama(), _word_tokenizer()

    monkeypatch.setattr(ckv_default_model, "load_default_from_gguf", fake_load)
    return calls


def staging_entries(cache: Path) -> list[str]:
    """The names in the cache's staging folder (none: an empty list)."""
    root = cache / "staging"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []
