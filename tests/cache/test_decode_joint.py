"""Cross-layer methods (layer-defensivekv) under a decode budget: each layer's share of the model's
decode budget is frozen from the prompt's joint selection, the shares sum exactly, every layer is
held to its share, and logits equal the masked reference (the oracle in test_decode_compression)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import criticalkv as ckv
from criticalkv.budgets import LayerJoint
from criticalkv.cache.decode.shares import joint_shares
from criticalkv.compat import cache_argument
from criticalkv.prompts import positions
from tests.cache.test_decode_compression import held_average, models, run_schedule
from tests.conftest import padded_batch


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 12),
    rows=st.integers(1, 3),
    window=st.integers(1, 8),
    extra=st.integers(0, 40),
    data=st.data(),
)
def test_shares_sum_exactly_and_cover_what_each_layer_holds(
    layers: int, rows: int, window: int, extra: int, data: st.DataObject
) -> None:
    budget = window + extra
    # what each layer kept of the prompt: at least its window, on average at most the decode budget
    prompt = data.draw(st.integers(window, budget))
    raw = data.draw(st.lists(st.floats(0.0, 1.0), min_size=layers * rows, max_size=layers * rows))
    weights = torch.tensor(raw, dtype=torch.float64).view(layers, rows)
    total = layers * (prompt - window)
    spread = weights / weights.sum(0).clamp_min(1e-12) * total if total else torch.zeros_like(weights)
    held = window + spread
    shares = joint_shares(held, budget, window)
    assert shares.dtype == torch.int64 and shares.shape == (layers, rows)
    assert torch.equal(shares.sum(0), torch.full((rows,), layers * budget))
    assert bool((shares >= window).all())
    assert bool((shares >= held - 1 - 1e-9).all())  # no layer starts above its share by more than rounding


def test_shares_follow_the_prompt_and_are_equal_when_the_layers_are() -> None:
    held = torch.tensor([[4.0], [4.0], [10.0], [22.0]])  # window 4: the last two layers earned 6 and 18
    shares = joint_shares(held, budget=16, window=4)
    assert shares[:, 0].tolist() == [4, 4, 16, 40]  # the 48 spare entries split 6:18, windows kept
    assert joint_shares(torch.full((3, 2), 7.0), 9, 4).tolist() == [[9, 9]] * 3


def joint_critical_snapkv() -> ckv.Method:
    """CriticalKV's SnapKV selection with budgets over all layers: not top-k, so the cache holds
    every layer whole until the joint selection (the unbounded path); on the tiny models its
    per-layer totals vary (layer-defensivekv's stage 1 takes the whole budget there, equally)."""
    return dataclasses.replace(ckv.get_method("critical-snapkv"), name="critical-snapkv-joint", budgets=LayerJoint())


@torch.no_grad()
@pytest.mark.parametrize("name", ["layer-defensivekv", "critical-snapkv-joint"])
def test_each_layer_is_held_to_its_share_through_generate(name: str) -> None:
    method = joint_critical_snapkv() if name == "critical-snapkv-joint" else ckv.get_method(name)
    model, _ = models("qwen2")
    ids, mask = padded_batch([44, 36], seed=11)
    budget, interval = 12, 3
    cache = ckv.CompressedCache.for_model(model, method, 0.5, window=4, decode_budget=budget, decode_interval=interval)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **cache_argument(model, cache))
    assert cache.decode is not None and len(cache.decode.layers) == cache.num_layers
    shares = torch.tensor([cache.decode.layers[i].budget for i in range(cache.num_layers)])  # (L, B)
    assert torch.equal(shares, joint_shares(held_average(cache), budget, 4))  # frozen from the prompt
    assert torch.equal(shares.sum(0), torch.full((2,), cache.num_layers * budget))
    if name == "critical-snapkv-joint":
        assert len(set(shares[:, 0].tolist())) > 1  # the joint selection gave the layers different shares
    for _ in range(40):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        step = torch.full((2, 1), 9)
        model(input_ids=step, attention_mask=mask, position_ids=positions(mask)[:, -1:], **cache_argument(model, cache))
        held = held_average(cache)  # (L, B) after each step: every layer within its share + interval
        assert bool((held <= shares + interval + 1e-9).all()), (held, shares)
    assert cache.decode.reselections > 0
    layers = cache.compressed_layers
    entry = 2 * layers[0].head_dim * 4  # float32 keys + values
    bound = len(layers) * 2 * layers[0].num_kv_heads * (budget + interval + 1) * entry
    assert cache.kv_bytes_peak() <= bound


def test_a_joint_method_that_holds_every_layer_decodes_like_the_reference() -> None:
    """A cross-layer method whose selection is not top-k holds each layer whole until the joint
    selection (the unbounded path), and decodes at its shares as well."""
    joint = joint_critical_snapkv()
    assert joint.cross_layer and not joint.needs.prefill_only
    worst, cache, held = run_schedule("llama", joint, [40, 30], 0.6, 10, 3, 4, 16, 4, seed=5)  # type: ignore[arg-type]
    assert worst < 1e-4
    assert cache.decode is not None and cache.decode.reselections > 0
    bound = cache.num_layers * (10 + 3 + 2)  # the chunk's padding (2 entries) may sit in the tail
    assert all(bool((step.sum(0) <= bound + 1e-9).all()) for step in held)
