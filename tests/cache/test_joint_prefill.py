"""Cross-layer budgets within a memory bound (criticalkv.cache.prefill.joint): the prefill holds
only the candidates that can still win the joint selection, the selection is the whole-prompt one
exactly, and the KV held during the prompt stays within the compressed size plus one layer."""

from __future__ import annotations

import pytest
import torch

import criticalkv as ckv
from criticalkv.budgets import LayerJoint
from criticalkv.cache.prefill import JointPrefill, bounded
from criticalkv.prompts import positions
from criticalkv.scores import WindowAttention
from criticalkv.select import Critical
from tests.conftest import make_tiny, padded_batch

WINDOW = 5


@torch.no_grad()
def _inflight(model: torch.nn.Module, method: str, budget: float, lengths: list[int]) -> tuple:
    ids, mask = padded_batch(lengths, seed=3)
    cache = ckv.CompressedCache.for_model(model, method, budget, window=WINDOW)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    states, _ = ckv.prefill(model, ids, mask, window=WINDOW)
    return cache, states


def test_only_top_ranked_cross_layer_methods_are_bounded() -> None:
    assert bounded(ckv.get_method("layer-defensivekv")) and bounded(ckv.get_method("kvzip"))
    assert not bounded(ckv.get_method("critical-kvzip"))  # its stage 2 ranks by another score
    assert not bounded(ckv.get_method("defensivekv"))  # per-layer budgets: nothing is deferred
    with pytest.raises(ValueError, match="bounded joint prefill"):
        JointPrefill(ckv.get_method("critical-kvzip"), 3)


@pytest.mark.parametrize("budget", [0.15, 0.3, 0.9])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bounded_prefill_selects_what_the_whole_prompt_selects(arch: str, budget: float) -> None:
    """Oracle: the in-flight cache (candidates only) keeps the masks and the exact keys and values
    that the joint selection over every layer's full state keeps (the cap binds from the first
    layer at 0.15 and 0.3, in the last layer only at 0.9)."""
    model = ckv.attach(make_tiny(arch))
    cache, states = _inflight(model, "layer-defensivekv", budget, [96, 80])
    method = ckv.get_method("layer-defensivekv")
    assert cache.budget_tokens is not None
    expected = method.keep_masks(states, cache.budget_tokens)
    for layer, keep, state in zip(cache.compressed_layers, expected, states, strict=True):
        assert torch.equal(layer.keep, keep)
        reference = ckv.cache.CompressedLayer(layer.layer_idx)
        reference.set_prefix(state.keys, state.values, keep)
        for got, want in zip(layer.storage.dense_prefix(), reference.storage.dense_prefix(), strict=True):
            assert torch.equal(got, want)


def _entry_bytes(cache: ckv.CompressedCache) -> int:
    layer = cache.compressed_layers[0]
    return 2 * layer.head_dim * torch.empty((), dtype=layer.dtype).element_size()


@pytest.mark.parametrize("budget", [0.1, 0.2, 0.4])
def test_kv_held_during_the_prompt_is_the_compressed_size_plus_one_layer(budget: float) -> None:
    """The bound: at most the L * H_kv * b entries the compressed cache keeps, plus the layer being
    prefilled whole; the whole-prompt deferral (critical-kvzip's) holds every layer whole."""
    model = ckv.attach(make_tiny("llama"))
    cache, states = _inflight(model, "layer-defensivekv", budget, [240])
    entry = _entry_bytes(cache)
    one_layer = states[0].keys.numel() * 2 * states[0].keys.element_size()
    full = one_layer * len(states)
    kept = int(cache.kept_entries().sum()) * entry
    assert cache.prefill_peak_bytes <= kept + one_layer
    assert cache.prefill_peak_bytes < (budget + 1 / len(states)) * full + one_layer * 0.01
    # a cross-layer method whose stage 2 ranks by another score than the budgets (critical-kvzip's case)
    unbounded = ckv.Method("joint-critical", "test", "test", WindowAttention(), budgets=LayerJoint(), select=Critical())
    assert not bounded(unbounded)
    whole = ckv.CompressedCache.from_states(states, unbounded, budget)
    assert whole.prefill_peak_bytes == full  # every layer held whole until the last one


def test_per_layer_methods_hold_the_layers_compressed_so_far_and_one_whole() -> None:
    model = ckv.attach(make_tiny("llama"))
    cache, states = _inflight(model, "snapkv", 0.2, [240])
    one_layer = states[0].keys.numel() * 2 * states[0].keys.element_size()
    assert cache.prefill_peak_bytes == cache.kv_bytes() + one_layer


@pytest.mark.parametrize(("budget", "binds"), [(0.15, True), (1.0, False)])
def test_candidates_held_between_layers_never_exceed_the_budget(budget: float, binds: bool) -> None:
    """Fed layer by layer, the candidates held never exceed the K selectable entries plus the
    windows of the layers seen; entries are dropped exactly when the cap binds."""
    model = ckv.attach(make_tiny("llama"))
    _, states = _inflight(model, "snapkv", 0.5, [200])
    method = ckv.get_method("layer-defensivekv")
    tokens = torch.tensor([int(budget * 200)])
    joint = JointPrefill(method, len(states))
    h = states[0].num_kv_heads
    selectable = len(states) * h * (int(tokens) - WINDOW)
    for seen, state in enumerate(states, start=1):
        done = joint.add(ckv.cache.CompressedLayer(state.layer_idx), state, tokens)
        if not done:
            held = sum(int(x.keep.sum()) for x in joint.held.values())
            assert held <= selectable + seen * h * WINDOW
    assert done and not joint.held
    assert (joint.dropped > 0) == binds
