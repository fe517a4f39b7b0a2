"""Where the plugin writes kept entries in a paged cache, against a plain reference (no vLLM needed).

The reference cache op below stores an entry the way vLLM's CPU layout holds it unpacked: one-head
block ``slot // bs``, keys in its first ``bs`` rows and values in the next ``bs``. The oracle: attention
over the compacted blocks (each head's first ``n`` entries) equals attention over the full sequence
with the evicted entries masked.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from criticalkv.vllm.paged import compacted_slots, compaction_order, gather_heads, head_blocks
from criticalkv.vllm.plugin_options import freed_blocks


def write(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """A reference of vLLM's cache update on :func:`head_blocks`'s view ((N, 1, d) keys and values)."""
    block_size = cache.shape[2]
    one_head = head_blocks(cache)
    view = one_head.view(one_head.shape[0], 2 * block_size, -1)
    for key, value, slot in zip(keys, values, slots.tolist(), strict=True):
        view[slot // block_size, slot % block_size] = key[0]
        view[slot // block_size, block_size + slot % block_size] = value[0]


def read(cache: torch.Tensor, table: torch.Tensor, heads: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, count, d) keys and values of entries ``0 .. count - 1`` under ``table`` (reference layout)."""
    one_head = head_blocks(cache)
    block_size = cache.shape[2]
    slots = compacted_slots(table, heads, count, block_size)
    view = one_head.view(one_head.shape[0], 2 * block_size, -1)
    keys = view[slots // block_size, slots % block_size]
    values = view[slots // block_size, block_size + slots % block_size]
    return keys, values


def _attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = torch.einsum("hd,htd->ht", query, keys).masked_fill(~mask, float("-inf"))
    return torch.einsum("ht,htd->hd", scores.softmax(-1), values)


@settings(max_examples=30, deadline=None)
@given(
    heads=st.integers(1, 4),
    prompt=st.integers(8, 90),
    share=st.floats(0.05, 0.95),
    tail=st.integers(0, 20),
    block=st.sampled_from([4, 8, 16]),
    seed=st.integers(0, 10_000),
)
def test_compacted_entries_attend_like_the_masked_full_sequence(
    heads: int, prompt: int, share: float, tail: int, block: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    dim = 8
    kept = max(1, int(share * prompt))
    computed = prompt + tail
    keys = torch.randn(heads, computed, dim, generator=generator)
    values = torch.randn(heads, computed, dim, generator=generator)
    keep = torch.zeros(heads, prompt, dtype=torch.bool)
    for head in range(heads):  # each head keeps other positions, the same count
        keep[head, torch.randperm(prompt, generator=generator)[:kept]] = True
    blocks = -(-computed // block) + 2
    cache = torch.full((blocks + 3, heads, block, 2 * dim), float("nan"))
    table = torch.randperm(blocks + 3, generator=generator)[: -(-computed // block)]
    first, last = freed_blocks(kept, prompt, block)
    compacted = torch.cat([table[:first], table[last:]])
    order = compaction_order(keep, computed)
    slots = compacted_slots(compacted, heads, order.shape[1], block)
    write(
        cache,
        gather_heads(keys, order).reshape(-1, 1, dim),
        gather_heads(values, order).reshape(-1, 1, dim),
        slots.reshape(-1),
    )
    held_keys, held_values = read(cache, compacted, heads, order.shape[1])
    query = torch.randn(heads, dim, generator=generator)
    mask = torch.cat([keep, torch.ones(heads, tail, dtype=torch.bool)], dim=-1)
    expected = _attention(query, keys, values, mask)
    got = _attention(query, held_keys, held_values, torch.ones(heads, order.shape[1], dtype=torch.bool))
    torch.testing.assert_close(got, expected)
    freed = set(table[first:last].tolist())
    assert all(torch.isnan(cache[b]).all() for b in freed)  # nothing written into the blocks given back


def test_each_head_keeps_its_own_positions_in_order() -> None:
    keep = torch.tensor([[1, 0, 1, 0, 1, 0], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert compaction_order(keep, 8).tolist() == [[0, 2, 4, 6, 7], [1, 2, 3, 6, 7]]


def test_unequal_counts_per_head_are_refused() -> None:
    keep = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    with pytest.raises(ValueError, match="same number of kept entries per KV head"):
        compaction_order(keep, 3)


def test_slots_need_enough_blocks() -> None:
    with pytest.raises(ValueError, match="need 3 blocks"):
        compacted_slots(torch.tensor([4, 5]), heads=2, count=9, block_size=4)


def test_only_vllms_contiguous_cpu_layout_is_taken() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        head_blocks(torch.zeros(2, 3, 4, 8).transpose(0, 1))
    assert head_blocks(torch.zeros(2, 3, 4, 8)).shape == (6, 1, 4, 8)
