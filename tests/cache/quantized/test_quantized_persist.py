"""Saving and loading a quantized cache: the same logits after loading, the bytes on disk, the header."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

import criticalkv as ckv
from criticalkv.cache.persist import read_header
from criticalkv.cache.quantized import QuantizedStorage
from criticalkv.runtime import append_tokens, prefill_into
from tests.conftest import ARCHS, make_tiny, padded_batch
from tests.helpers.tiny_tokenizer import char_tokenizer

WINDOW = 6


def quantized(model: PreTrainedModel, bits: int, lengths: tuple[int, ...] = (40, 29), **storage: int):
    ids, mask = padded_batch(list(lengths), seed=3)
    options = {"kv_bits": bits, "kv_group_size": 4, "kv_residual": 3, **storage}
    cache = ckv.CompressedCache.for_model(model, "critical-adakv", 0.4, window=WINDOW, **options)
    prefill_into(model, cache, ids, mask)
    return cache, mask


def greedy_logits(
    model: PreTrainedModel, cache: ckv.CompressedCache, mask: torch.Tensor, steps: int = 9
) -> list[torch.Tensor]:
    question = torch.tensor([[5, 9, 13, 17, 21]] * mask.shape[0])
    out, mask = append_tokens(model, cache, mask, question)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        out, mask = append_tokens(model, cache, mask, logits[-1].argmax(-1, keepdim=True))
        logits.append(out.logits[:, -1])
    return logits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bits", [4, 8])
@torch.no_grad()
def test_a_loaded_quantized_cache_decodes_with_the_same_logits(arch: str, bits: int, tmp_path: Path) -> None:
    model, tokenizer = ckv.attach(make_tiny(arch)), char_tokenizer()
    cache, mask = quantized(model, bits)
    path = tmp_path / "q.ckv"
    cache.save(path, model, tokenizer)
    loaded = ckv.CompressedCache.load(path, model, tokenizer)
    assert loaded.quantization == cache.quantization and loaded.kv_bytes() == cache.kv_bytes()
    assert read_header(path)["storage"] == {"kv_bits": bits, "kv_group_size": 4, "kv_residual": 3}
    for mine, theirs in zip(cache.keep_masks(), loaded.keep_masks(), strict=True):
        assert torch.equal(mine, theirs)
    layer = cache.compressed_layers[0]
    assert isinstance(layer.storage, QuantizedStorage) and layer.holds_prompt
    assert layer.storage.prefix.partial is not None  # heads with a partial block take part  # type: ignore[attr-defined]
    for a, b in zip(greedy_logits(model, cache.fork(), mask), greedy_logits(model, loaded.fork(), mask), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(greedy_logits(model, cache, mask), greedy_logits(model, loaded, mask), strict=True):
        assert torch.equal(a, b)


@torch.no_grad()
def test_a_cache_with_a_quantized_tail_and_residual_round_trips(tmp_path: Path) -> None:
    model = ckv.attach(make_tiny("llama"))
    cache, mask = quantized(model, 4)
    _, mask = append_tokens(model, cache, mask, torch.tensor([list(range(7, 19))] * 2))  # 12 tokens: tail blocks
    layer = cache.compressed_layers[0]
    assert (
        isinstance(layer.storage, QuantizedStorage) and layer.storage.tail_used > 0 and layer.storage.residual_len > 0
    )
    cache.save(tmp_path / "t.ckv", model)
    loaded = ckv.CompressedCache.load(tmp_path / "t.ckv", model)
    assert loaded.kv_bytes() == cache.kv_bytes()
    for a, b in zip(greedy_logits(model, cache, mask), greedy_logits(model, loaded, mask), strict=True):
        assert torch.equal(a, b)


@torch.no_grad()
def test_size_on_disk_is_kv_bytes_plus_a_small_header(tmp_path: Path) -> None:
    """A prefilled quantized cache holds only its prefix: the file is its kv_bytes plus the bookkeeping."""
    model = ckv.attach(make_tiny("llama"))
    cache, _ = quantized(model, 4, lengths=(300, 200), kv_group_size=8)
    size = cache.save(tmp_path / "c.ckv", model)
    assert size == (tmp_path / "c.ckv").stat().st_size
    layers = cache.compressed_layers
    segments = layers[0].batch_size * layers[0].num_kv_heads
    metadata = sum(2 * 8 * segments + -(-segments * int(layer.keep.shape[-1]) // 8) for layer in layers)  # type: ignore[union-attr]
    overhead = size - cache.kv_bytes()
    assert metadata < overhead < metadata + 16384, (overhead, metadata)
    unquantized = ckv.CompressedCache.for_model(model, "critical-adakv", 0.4, window=WINDOW)
    ids, mask = padded_batch([300, 200], seed=3)
    prefill_into(model, unquantized, ids, mask)
    assert cache.kv_bytes() < unquantized.kv_bytes() / 3  # head dim 16, group 8: 4 + 4 bits of statistics
