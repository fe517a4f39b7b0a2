"""Saving and loading a compressed cache: a loaded cache decodes exactly like the one saved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from criticalkv import CompressedCache, attach
from criticalkv.cache.persist import CacheFileError, IncompatibleCacheError, read_header
from criticalkv.runtime import append_tokens, prefill_into
from tests.conftest import ARCHS, make_tiny, padded_batch
from tests.helpers.tiny_tokenizer import char_tokenizer

WINDOW = 8


def compressed(model, method: str = "critical-adakv", budget: float = 0.4, lengths=(40, 28)):
    ids, mask = padded_batch(list(lengths), seed=3)
    cache = CompressedCache.for_model(model, method, budget, window=WINDOW)
    prefill_into(model, cache, ids, mask)
    return cache, mask


def greedy_logits(model, cache, mask: torch.Tensor, steps: int = 4) -> list[torch.Tensor]:
    """Logits of a fixed question then of ``steps`` greedy tokens appended to ``cache``."""
    question = torch.tensor([[5, 9, 13, 17, 21]] * mask.shape[0])
    out, mask = append_tokens(model, cache, mask, question)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        out, mask = append_tokens(model, cache, mask, token)
        logits.append(out.logits[:, -1])
    return logits


@pytest.mark.parametrize("arch", ARCHS)
def test_loaded_cache_decodes_like_the_saved_one(arch: str, tmp_path: Path) -> None:
    model = attach(make_tiny(arch))
    tokenizer = char_tokenizer()
    cache, mask = compressed(model)
    path = tmp_path / "ctx.ckv"
    size = cache.save(path, model, tokenizer, mode="question-agnostic")
    loaded = CompressedCache.load(path, model, tokenizer)
    assert loaded.kv_bytes() == cache.kv_bytes()
    assert torch.equal(loaded.kept_entries(), cache.kept_entries())
    for mine, theirs in zip(cache.keep_masks(), loaded.keep_masks(), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(loaded.real_prompt_tokens, cache.real_prompt_tokens)
    assert size > cache.kv_bytes()
    assert loaded.method.name == "critical-adakv" and loaded.budget == 0.4 and loaded.window == WINDOW
    assert read_header(path)["fields"] == {"mode": "question-agnostic"}
    # the kept entries have different counts per head: the oracle covers the ragged case
    assert len(set(cache.kept_entries().flatten().tolist())) > 1
    # forks of both decode identically, and so do the caches themselves
    for a, b in zip(greedy_logits(model, cache.fork(), mask), greedy_logits(model, loaded.fork(), mask), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(greedy_logits(model, cache, mask), greedy_logits(model, loaded, mask), strict=True):
        assert torch.equal(a, b)


def test_size_on_disk_is_kv_bytes_plus_a_small_header(tiny_llama, tmp_path: Path) -> None:
    model = attach(tiny_llama)
    cache, _ = compressed(model, lengths=(300, 200))
    size = cache.save(tmp_path / "c.ckv", model)
    assert size == (tmp_path / "c.ckv").stat().st_size
    layers = cache.compressed_layers
    segments = layers[0].batch_size * layers[0].num_kv_heads
    # per layer: perm and lengths (int64 per segment), the keep mask at one bit per prompt position
    metadata = sum(2 * 8 * segments + -(-segments * int(layer.keep.shape[-1]) // 8) for layer in layers)
    overhead = size - cache.kv_bytes()
    assert metadata < overhead < metadata + 8192, (overhead, metadata)


def test_a_cache_with_a_tail_round_trips(tiny_llama, tmp_path: Path) -> None:
    model = attach(tiny_llama)
    cache, mask = compressed(model)
    _, mask = append_tokens(model, cache, mask, torch.tensor([[7, 8, 9]] * 2))
    cache.save(tmp_path / "t.ckv", model)
    loaded = CompressedCache.load(tmp_path / "t.ckv", model)
    assert loaded.kv_bytes() == cache.kv_bytes()
    for a, b in zip(greedy_logits(model, cache, mask), greedy_logits(model, loaded, mask), strict=True):
        assert torch.equal(a, b)


def test_another_model_or_tokenizer_is_refused(tiny_llama, tmp_path: Path) -> None:
    model = attach(tiny_llama)
    tokenizer = char_tokenizer()
    cache, _ = compressed(model)
    path = tmp_path / "c.ckv"
    cache.save(path, model, tokenizer)
    with pytest.raises(IncompatibleCacheError, match=r"another model.*weights"):
        CompressedCache.load(path, attach(make_tiny("llama", seed=1)), tokenizer)
    with pytest.raises(IncompatibleCacheError, match=r"another model.*config fields"):
        CompressedCache.load(path, attach(make_tiny("qwen2")), tokenizer)
    other = char_tokenizer()
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(IncompatibleCacheError, match="another tokenizer"):
        CompressedCache.load(path, model, other)


def test_truncated_or_corrupted_files_are_refused(tiny_llama, tmp_path: Path) -> None:
    model = attach(tiny_llama)
    cache, _ = compressed(model)
    path = tmp_path / "c.ckv"
    cache.save(path, model)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.ckv"
    truncated.write_bytes(data[: len(data) - 100])
    with pytest.raises(CacheFileError, match="truncated or corrupted"):
        CompressedCache.load(truncated, model)
    flipped = bytearray(data)
    flipped[-10] ^= 0xFF  # a byte of the last tensor's data
    corrupted = tmp_path / "corrupted.ckv"
    corrupted.write_bytes(bytes(flipped))
    with pytest.raises(CacheFileError, match="checksum"):
        CompressedCache.load(corrupted, model)
    (tmp_path / "junk.ckv").write_bytes(b"not a cache at all")
    with pytest.raises(CacheFileError):
        CompressedCache.load(tmp_path / "junk.ckv", model)
    with pytest.raises(FileNotFoundError, match="no cache file"):
        CompressedCache.load(tmp_path / "missing.ckv", model)


def test_the_write_is_atomic_and_replaces(tiny_llama, tmp_path: Path) -> None:
    model = attach(tiny_llama)
    first, _ = compressed(model, budget=0.4)
    second, _ = compressed(model, budget=0.8)
    path = tmp_path / "c.ckv"
    first.save(path, model)
    second.save(path, model)
    assert [p.name for p in tmp_path.iterdir()] == ["c.ckv"]  # no temporary file left behind
    assert CompressedCache.load(path, model).budget == 0.8


def test_an_empty_cache_cannot_be_saved(tiny_llama, tmp_path: Path) -> None:
    cache = CompressedCache.for_model(tiny_llama, "critical-adakv", 0.4, window=WINDOW)
    with pytest.raises(ValueError, match="prefill it first"):
        cache.save(tmp_path / "c.ckv", tiny_llama)
    assert not list(tmp_path.iterdir())
