"""Uniform layers decode through one sdpa call over a fused prefix+tail buffer; ragged ones do not."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

import criticalkv as ckv
from criticalkv.compat import cache_argument
from criticalkv.prompts import positions
from tests.conftest import padded_batch


def _prefill_and_decode(
    model: PreTrainedModel, method: str, steps: int = 3, lengths: tuple[int, int] = (80, 80)
) -> ckv.CompressedCache:
    """Rows of equal length give every head of a uniform method the same count (one tier)."""
    ckv.attach(model)
    ids, mask = padded_batch(list(lengths), seed=4)
    cache = ckv.CompressedCache.for_model(model, method, 0.3, window=6)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **cache_argument(model, cache))
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        pos = positions(mask)[:, -1:]
        out = model(input_ids=token, attention_mask=mask, position_ids=pos, **cache_argument(model, cache))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return cache


def test_uniform_budgets_decode_from_one_fused_buffer(tiny_llama: PreTrainedModel) -> None:
    cache = _prefill_and_decode(tiny_llama, "snapkv")
    for layer in cache.compressed_layers:
        assert layer.fused is not None and layer.prefix is not None and layer.tail_keys is not None
        keys, _ = layer.fused
        # the prefix tier and the tail are views of the one buffer: no second copy is held
        assert layer.prefix.tiers[0].keys.data_ptr() == keys.data_ptr()
        assert layer.tail_keys.data_ptr() == keys[:, layer.prefix.tiers[0].keys.shape[1] :].data_ptr()
        width = layer.prefix.tiers[0].keys.shape[1]
        assert layer.nbytes() == 2 * keys.numel() * keys.element_size()
        assert keys.shape[1] == width + layer.tail_capacity()


def test_ragged_budgets_keep_the_tiered_layout(tiny_llama: PreTrainedModel) -> None:
    for method, lengths in (("adakv", (80, 80)), ("snapkv", (90, 70))):  # ragged heads, ragged rows
        cache = _prefill_and_decode(tiny_llama, method, lengths=lengths)
        layers = cache.compressed_layers
        ragged = [layer for layer in layers if layer.prefix is not None and len(layer.prefix.tiers) > 1]
        assert ragged, f"{method} on rows of {lengths} tokens should give some layer different segment lengths"
        assert all(layer.fused is None for layer in ragged)


def test_a_fork_shares_the_prefix_and_appends_to_its_own_tail(tiny_llama: PreTrainedModel) -> None:
    cache = _prefill_and_decode(tiny_llama, "snapkv", steps=1)
    clone = cache.fork()
    before = [layer.tail_keys[:, : layer.tail_len].clone() for layer in cache.compressed_layers]  # type: ignore[index]
    ids = torch.tensor([[5], [6]])
    mask = torch.ones(2, clone.get_seq_length() + 1, dtype=torch.long)  # the fork holds the prompt, not the tail
    tiny_llama(input_ids=ids, attention_mask=mask, **cache_argument(tiny_llama, clone))
    for mine, theirs, old in zip(cache.compressed_layers, clone.compressed_layers, before, strict=True):
        assert theirs.fused is None and theirs.tail_len == 1
        assert torch.equal(mine.tail_keys[:, : mine.tail_len], old)  # type: ignore[index]
