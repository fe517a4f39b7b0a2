"""The context store trusts only what it wrote under each name (issue 30, case 3). Before: with
``--store S``, copying context B's file over context A's while A was out of memory made asking A
answer with B's document (200), and after a restart a renamed copy answered ``GET`` with the
other id. Now a file whose header names another id, or a symbolic link, is refused (409 when
asked for, skipped with a warning at a restart), and a 500's body names no path."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

import criticalkv as ckv
from criticalkv.runtime import prefill_into
from criticalkv.serve.errors import APIError, server_error
from criticalkv.serve.store import ContextStore
from tests.conftest import make_tiny, padded_batch
from tests.helpers.tiny_tokenizer import char_tokenizer


def _store_two(folder: Path, one_in_memory: bool = False) -> tuple[ContextStore, str, str]:
    """Two stored contexts (``one_in_memory``: a cap that holds one, so the first is spilled)."""
    model, tokenizer = ckv.attach(make_tiny("llama")), char_tokenizer()
    caches = []
    for seed in (1, 2):
        tokens, mask = padded_batch([30], seed=seed)
        cache = ckv.CompressedCache.for_model(model, "snapkv", 0.5, window=4)
        with torch.no_grad():
            prefill_into(model, cache, tokens, mask)
        caches.append(cache)
    cap = max(c.kv_bytes() for c in caches) + 1 if one_in_memory else 10**9
    store = ContextStore(folder, cap, model, tokenizer)
    ids = [store.add(cache, 30, ckv.CacheSpec.of("snapkv", 0.5, 4)).id for cache in caches]
    return store, ids[0], ids[1]


def test_a_swapped_file_is_refused_not_answered(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, a, b = _store_two(tmp_path)
    fresh = ContextStore(tmp_path, 10**9, store.model, store.tokenizer)  # A is on disk only
    shutil.copyfile(tmp_path / f"{b}.ckv", tmp_path / f"{a}.ckv")
    with caplog.at_level(logging.WARNING), pytest.raises(APIError) as refused:
        fresh.get(a)
    assert refused.value.status == 409 and "holds another context" in refused.value.message
    assert fresh.get(b)[0].id == b  # the untouched one still answers
    restarted = ContextStore(tmp_path, 10**9, store.model, store.tokenizer)
    assert not restarted.has(a) and restarted.has(b)  # skipped at the restart, with a warning
    assert "not the one its name says" in caplog.text


def test_a_renamed_copy_or_a_link_is_not_served(tmp_path: Path) -> None:
    store, a, b = _store_two(tmp_path)
    copy = "ctx_" + "0" * (len(a) - 4)
    shutil.copyfile(tmp_path / f"{a}.ckv", tmp_path / f"{copy}.ckv")
    (tmp_path / f"{b}.ckv").unlink()
    (tmp_path / f"{b}.ckv").symlink_to(tmp_path / f"{a}.ckv")
    restarted = ContextStore(tmp_path, 10**9, store.model, store.tokenizer)
    assert restarted.has(a) and not restarted.has(copy) and not restarted.has(b)


def test_a_500_names_no_path() -> None:
    error = server_error(FileNotFoundError(2, "No such file or directory", "/srv/store/ctx_abc.ckv"))
    assert error.status == 500 and "/srv/store" not in error.message and "FileNotFoundError" in error.message


def test_a_file_under_the_right_id_but_not_the_one_written_is_refused(tmp_path: Path) -> None:
    """A file claiming context A's id, written by someone else (its checksum is not the one the
    store recorded when it wrote A), is refused too; a store without records still serves."""
    store, a, b = _store_two(tmp_path, one_in_memory=True)  # A is on disk only
    assert store.info(a)["in_memory"] is False
    fields = {k: v for k, v in store.info(b).items() if k not in ("object", "in_memory", "kv_bits")} | {"id": a}
    _, other = store.get(b)
    other.save(tmp_path / f"{a}.ckv", store.model, store.tokenizer, mode="question-agnostic", **fields)
    with pytest.raises(APIError) as refused:
        store.get(a)
    assert refused.value.status == 409 and "holds another context" in refused.value.message
    fresh = ContextStore(tmp_path, 10**9, store.model, store.tokenizer)
    assert not fresh.has(a) and fresh.has(b)  # skipped when the folder is read again
    (tmp_path / f"{b}.sum").unlink()  # an older store, without records: trusted by its id alone
    assert ContextStore(tmp_path, 10**9, store.model, store.tokenizer).has(b)
