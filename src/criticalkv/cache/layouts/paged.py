"""The ragged prefix as the paged layout of ``torch.ops.criticalkv.ragged_decode``.

The tiers are pooled once into one (E, d) keys tensor and one values tensor, and the tiers become
views of them (the bytes are not held twice). Each sorted segment's entries are then listed, in
order, as pool rows: a block table with one entry a block (``block_size`` 1), built once per prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.cache.layouts.tiers import RaggedPrefix, Tier


@dataclass(frozen=True)
class PagedPrefix:
    """Pool and block table of a :class:`RaggedPrefix`, segments in sorted order."""

    keys: torch.Tensor  # (E, d)
    values: torch.Tensor  # (E, d)
    table: torch.Tensor  # (S, longest) int32 pool rows, -1 past a segment's length
    lengths: torch.Tensor  # (S,) int32, sorted order


def paged_prefix(prefix: RaggedPrefix, segments: int, head_dim: int, like: torch.Tensor) -> PagedPrefix:
    """The paged view of ``prefix`` (memoized on it); its tiers become views of the pool."""
    if prefix.paged is not None:
        return prefix.paged
    tiers = prefix.tiers
    keys = torch.cat([t.keys.reshape(-1, head_dim) for t in tiers]) if tiers else like.new_zeros(0, head_dim)
    values = torch.cat([t.values.reshape(-1, head_dim) for t in tiers]) if tiers else like.new_zeros(0, head_dim)
    width = sum(int(t.keys.shape[1]) for t in tiers)
    table = torch.full((segments, max(1, width)), -1, dtype=torch.int32, device=keys.device)
    views, offset, column = [], 0, 0
    for tier in tiers:
        n, w = int(tier.keys.shape[0]), int(tier.keys.shape[1])
        rows = offset + torch.arange(n, device=keys.device)[:, None] * w + torch.arange(w, device=keys.device)
        table[:n, column : column + w] = rows.to(torch.int32)
        views.append(
            Tier(
                keys[offset : offset + n * w].view(n, w, head_dim), values[offset : offset + n * w].view(n, w, head_dim)
            )
        )
        offset, column = offset + n * w, column + w
    prefix.tiers = views
    sorted_lengths = prefix.lengths if prefix.identity else prefix.lengths[prefix.perm]
    prefix.paged = PagedPrefix(keys, values, table, sorted_lengths.to(torch.int32))
    return prefix.paged
