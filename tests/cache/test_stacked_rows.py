"""``cache.batch.stacked_cache`` and ``decode_budget_cache`` take whole specs: what they refuse."""

from __future__ import annotations

import pytest
import torch

import criticalkv as ckv
from criticalkv.cache.batch import decode_budget_cache, stacked_cache
from criticalkv.runtime import prefill
from tests.conftest import make_tiny, padded_batch

WINDOW = 6


@pytest.fixture(scope="module")
def states() -> list:
    model = ckv.attach(make_tiny("llama"))
    ids, mask = padded_batch([60], seed=2)
    with torch.no_grad():
        prefilled, _ = prefill(model, ids, mask, window=WINDOW)
    return prefilled


def test_rows_keep_their_specs_storage(states: list) -> None:
    specs = [ckv.CacheSpec.of("snapkv", 0.3, WINDOW, kv_bits=8), ckv.CacheSpec.of("full", 1.0, WINDOW, kv_bits=8)]
    cache, times = stacked_cache(states, specs)
    assert len(times) == 2 and cache.quantization == specs[0].storage
    assert cache.kept_entries()[:, 1].sum() == states[0].lengths.item() * cache.kept_entries()[:, 1].numel()


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([], "at least one spec"),
        ([ckv.CacheSpec.of("snapkv", 0.3, WINDOW), ckv.CacheSpec.of("full", 1.0, WINDOW, kv_bits=8)], "one storage"),
        ([ckv.CacheSpec.of("snapkv", 0.3, WINDOW + 1)], f"prefilled with window {WINDOW}"),
        ([ckv.CacheSpec.of("snapkv", 30, WINDOW, decode_budget=16)], "use decode_budget_cache"),
    ],
)
def test_stacking_refuses_rows_it_cannot_hold(states: list, specs: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stacked_cache(states, specs)


def test_a_decode_budget_cache_needs_a_decode_budget(states: list) -> None:
    with pytest.raises(ValueError, match="use stacked_cache"):
        decode_budget_cache(states, ckv.CacheSpec.of("snapkv", 30, WINDOW))
    cache, _ = decode_budget_cache(states, ckv.CacheSpec.of("snapkv", 30, WINDOW, decode_budget=16))
    assert cache.decode is not None
