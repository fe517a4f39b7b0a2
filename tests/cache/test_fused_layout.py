"""Owned layers decode from length buckets (cache/layouts/length_buckets.py): one dense prefix+tail buffer and one
sdpa call per kept length, no second copy of any entry; readers get the tiers back via ``settle``."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

import criticalkv as ckv
from criticalkv.compat import cache_argument
from criticalkv.prompts import positions
from tests.conftest import padded_batch


def _prefill(model: PreTrainedModel, method: str, lengths: tuple[int, int]) -> tuple[ckv.CompressedCache, dict]:
    ckv.attach(model)
    ids, mask = padded_batch(list(lengths), seed=4)
    cache = ckv.CompressedCache.for_model(model, method, 0.3, window=6)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **cache_argument(model, cache))
    return cache, {"mask": mask, "token": out.logits[:, -1].argmax(-1, keepdim=True)}


def _decode(model: PreTrainedModel, cache: ckv.CompressedCache, run: dict, steps: int) -> list[torch.Tensor]:
    logits = []
    for _ in range(steps):
        run["mask"] = torch.cat([run["mask"], torch.ones_like(run["token"])], 1)
        pos = positions(run["mask"])[:, -1:]
        out = model(
            input_ids=run["token"], attention_mask=run["mask"], position_ids=pos, **cache_argument(model, cache)
        )
        run["token"] = out.logits[:, -1].argmax(-1, keepdim=True)
        logits.append(out.logits[:, -1])
    return logits


def _segments(layer: ckv.CompressedCache) -> list[torch.Tensor]:
    return [torch.cat(layer.storage.prefix.segment(s)) for s in range(layer.batch_size * layer.num_kv_heads)]


def test_uniform_budgets_decode_from_one_bucket_whose_views_are_the_tiers(tiny_llama: PreTrainedModel) -> None:
    cache, run = _prefill(tiny_llama, "snapkv", (80, 80))
    _decode(tiny_llama, cache, run, 3)
    for layer in cache.compressed_layers:
        assert layer.storage.fused is not None and layer.storage.fused.single and layer.holds_prompt
        assert layer.storage.tail_keys is not None
        flat = layer.storage.fused.flat_keys
        # the prefix tier and the tail are views of the one buffer: no second copy is held
        assert layer.storage.prefix.tiers[0].keys.data_ptr() == flat.data_ptr()
        width = layer.storage.prefix.tiers[0].keys.shape[1]
        assert layer.storage.tail_keys.data_ptr() == layer.storage.fused.buckets[0].keys[:, width:].data_ptr()
        assert layer.nbytes() == 2 * flat.numel() * flat.element_size()
        assert flat.shape[0] == layer.batch_size * layer.num_kv_heads * (width + layer.tail_capacity())


def test_ragged_layers_get_one_bucket_per_length_and_hold_each_entry_once(tiny_llama: PreTrainedModel) -> None:
    for method, lengths in (("adakv", (80, 80)), ("snapkv", (90, 70))):  # ragged heads, ragged rows
        cache, run = _prefill(tiny_llama, method, lengths)
        before = [_segments(layer) for layer in cache.compressed_layers]
        _decode(tiny_llama, cache, run, 3)
        ragged = [i for i, layer in enumerate(cache.compressed_layers) if not layer.storage.fused.single]  # type: ignore[union-attr]
        assert ragged, f"{method} on rows of {lengths} tokens should give some layer different segment lengths"
        for i in ragged:
            layer = cache.compressed_layers[i]
            assert layer.storage.fused is not None and layer.holds_prompt
            lengths_sorted = layer.storage.prefix.lengths[layer.storage.prefix.perm].tolist()
            assert [b.length for b in layer.storage.fused.buckets] == sorted(set(lengths_sorted), reverse=True)
            for bucket in layer.storage.fused.buckets:
                n = bucket.keys.shape[0]
                assert set(lengths_sorted[bucket.start : bucket.start + n]) == {bucket.length}
            # the tiers are given up, not kept beside the buckets: bytes are kept entries plus tail capacity
            assert layer.storage.prefix.tiers == [] and layer.storage.tail_keys is None
            segments, capacity, d = layer.batch_size * layer.num_kv_heads, layer.tail_capacity(), layer.head_dim
            entry = 2 * d * layer.dtype.itemsize
            assert layer.nbytes() == (int(layer.storage.prefix.lengths.sum()) + segments * capacity) * entry
            layer.storage.settle()
            assert layer.storage.fused is None and layer.storage.tail_keys is not None
            assert layer.nbytes() == (int(layer.storage.prefix.lengths.sum()) + segments * capacity) * entry
            for old, new in zip(before[i], _segments(layer), strict=True):
                assert torch.equal(old, new)  # the staircase comes back entry for entry


def test_settling_midway_changes_nothing_downstream(tiny_llama: PreTrainedModel) -> None:
    """Settle (as saving, forking and re-selection do) mid-decode, then keep decoding: same logits."""
    plain, run_a = _prefill(tiny_llama, "adakv", (90, 70))
    settled, run_b = _prefill(tiny_llama, "adakv", (90, 70))
    first = _decode(tiny_llama, plain, run_a, 5)
    second = _decode(tiny_llama, settled, run_b, 2)
    for layer in settled.compressed_layers:
        layer.storage.settle()
    second += _decode(tiny_llama, settled, run_b, 3)
    assert any(
        layer.storage.fused is not None and not layer.storage.fused.single for layer in settled.compressed_layers
    )
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_fork_shares_the_prefix_and_appends_to_its_own_tail(tiny_llama: PreTrainedModel) -> None:
    for method in ("snapkv", "adakv"):
        cache, run = _prefill(tiny_llama, method, (80, 80))
        _decode(tiny_llama, cache, run, 1)
        clone = cache.fork()
        before = [layer.storage.tail_keys[:, : layer.tail_len].clone() for layer in cache.compressed_layers]  # type: ignore[index]
        ids = torch.tensor([[5], [6]])
        mask = torch.ones(2, clone.get_seq_length() + 1, dtype=torch.long)  # the fork holds the prompt, not the tail
        tiny_llama(input_ids=ids, attention_mask=mask, **cache_argument(tiny_llama, clone))
        for mine, theirs, old in zip(cache.compressed_layers, clone.compressed_layers, before, strict=True):
            assert theirs.storage.fused is None and theirs.tail_len == 1
            assert theirs.storage.prefix is mine.storage.prefix  # shared, not copied
            assert torch.equal(mine.storage.tail_keys[:, : mine.tail_len], old)  # type: ignore[index]
