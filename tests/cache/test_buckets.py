"""The length-bucket decode kernel against the tier kernel it replaces (oracle), on random layouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from criticalkv.cache.layouts import LengthBuckets, build_prefix, ragged_attention

D = 8


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    tail=st.integers(1, 5),
    group=st.integers(1, 3),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_buckets_attend_like_the_tiers(lengths: list[int], tail: int, group: int, masked: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    s, t = len(lengths), 12
    keys, values = torch.randn(1, s, t, D, generator=g), torch.randn(1, s, t, D, generator=g)
    keep = torch.zeros(1, s, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        keep[0, i, torch.randperm(t, generator=g)[:n]] = True
    prefix = build_prefix(keys, values, keep)
    tail_k, tail_v = torch.randn(s, tail, D, generator=g), torch.randn(s, tail, D, generator=g)
    # entries are written in the original order, read in the sorted one
    buckets = LengthBuckets.build(prefix, None, None, 0, tail + 2, keys)
    buckets.write(tail_k[prefix.inv_perm][:, :1], tail_v[prefix.inv_perm][:, :1], 0)
    buckets.write(tail_k[prefix.inv_perm][:, 1:], tail_v[prefix.inv_perm][:, 1:], 1)
    query = torch.randn(s, group, D, generator=g)
    mask = None
    if masked:
        mask = torch.rand(s, group, tail, generator=g) > 0.3
        mask[..., 0] = True  # every query sees at least one entry
    # the buckets take and give the original order, the tiers the sorted one
    original = (query[prefix.inv_perm], None if mask is None else mask[prefix.inv_perm])
    got = buckets.attend(*original, tail, 0.3)
    want = ragged_attention(query, prefix.tiers, tail_k, tail_v, mask, 0.3)[prefix.inv_perm]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the staircase comes back exactly; bytes are the kept entries plus the tail capacity
    for mine, theirs in zip(buckets.tiers(), prefix.tiers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert torch.equal(buckets.tail()[0][:, :tail], tail_k)
    assert buckets.nbytes() == (sum(lengths) + s * (tail + 2)) * 2 * D * 4
    grown = buckets.grown(prefix, tail, tail + 9)
    torch.testing.assert_close(grown.attend(*original, tail, 0.3), want, rtol=1e-5, atol=1e-5)


def test_a_write_past_the_capacity_or_a_small_capacity_is_refused() -> None:
    keys = torch.randn(1, 2, 4, D)
    prefix = build_prefix(keys, keys, torch.ones(1, 2, 4, dtype=torch.bool))
    buckets = LengthBuckets.build(prefix, None, None, 0, 2, keys)
    with pytest.raises(ValueError, match="grow first"):
        buckets.write(torch.randn(2, 3, D), torch.randn(2, 3, D), 0)
    with pytest.raises(ValueError, match="cannot hold"):
        LengthBuckets.build(prefix, torch.randn(2, 4, D), torch.randn(2, 4, D), 4, 2, keys)
