"""The ragged prefix of a compressed layer, stored as a staircase of dense tiers.

Each (batch row, KV head) is a *segment* holding exactly the entries it kept. Segments are
sorted by length, longest first; tier ``j`` holds entries ``[l_{j-1}, l_j)`` of every
segment that has at least ``l_j`` entries, where ``l_1 < l_2 < ...`` are the distinct
lengths. Tiers hold no padding, so bytes equal kept entries exactly, and each tier is one
dense batched matmul at decode time (no per-head Python loop). A uniform budget gives one tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Tier:
    """Entries ``[start, start + length)`` of the first ``keys.shape[0]`` sorted segments."""

    keys: torch.Tensor  # (n, length, d)
    values: torch.Tensor  # (n, length, d)

    @property
    def num_segments(self) -> int:
        return int(self.keys.shape[0])

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass
class RaggedPrefix:
    """Kept entries of every segment of one layer.

    ``perm[i]`` is the segment (``b * H_kv + h``) at sorted position ``i``; ``lengths`` are
    per segment in the original order.
    """

    tiers: list[Tier]
    perm: torch.Tensor  # (S,) int64
    inv_perm: torch.Tensor  # (S,) int64
    lengths: torch.Tensor  # (S,) int64
    identity: bool = False  # ``perm`` is the identity (equal lengths): no reordering needed
    #: the tiers pooled as the decode op's paged layout (:mod:`~criticalkv.cache.layouts.paged`), once read
    paged: Any = None

    @property
    def num_entries(self) -> int:
        return int(self.lengths.sum())

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.tiers)

    def segment(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (L_s, d) of segment ``s`` (original order), in position order."""
        i = int(self.inv_perm[s])
        parts = [(t.keys[i], t.values[i]) for t in self.tiers if t.num_segments > i]
        return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])


def segment_order(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keep_s, lengths, perm, inv_perm)`` of a (B, H_kv, T) keep mask: the mask as (S, T)
    segments, each segment's kept count, the order sorting segments longest first (stable) and its
    inverse."""
    s = keep.shape[0] * keep.shape[1]
    keep_s = keep.reshape(s, keep.shape[-1])
    lengths = keep_s.sum(-1)
    perm = torch.argsort(lengths, descending=True, stable=True)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(s, device=perm.device)
    return keep_s, lengths, perm, inv_perm


def build_prefix(keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> RaggedPrefix:
    """Gather the kept entries of (B, H_kv, T, d) ``keys``/``values`` into tiers.

    ``keep`` is (B, H_kv, T) bool; each segment keeps its entries in position order.
    """
    b, h, t, d = keys.shape
    s = b * h
    keep_s, lengths, perm, inv_perm = segment_order(keep)
    sorted_lengths = lengths[perm]
    # kept positions first, in position order, per segment
    positions = torch.argsort((~keep_s).to(torch.int8), dim=-1, stable=True)
    keys_s, values_s = keys.reshape(s, t, d), values.reshape(s, t, d)
    levels = torch.unique(sorted_lengths).tolist()
    tiers: list[Tier] = []
    previous = 0
    for level in levels:
        if level == 0:
            continue
        n = int((sorted_lengths >= level).sum())
        rows = perm[:n, None]
        cols = positions[rows[:, 0], previous:level]
        tiers.append(Tier(keys_s[rows, cols].contiguous(), values_s[rows, cols].contiguous()))
        previous = level
    return RaggedPrefix(tiers, perm, inv_perm, lengths, identity=len(levels) <= 1)


def restore_prefix(
    keys: torch.Tensor, values: torch.Tensor, perm: torch.Tensor, lengths: torch.Tensor, d: int, identity: bool
) -> RaggedPrefix:
    """The prefix whose tiers were saved concatenated as flat ``keys``/``values`` (the layout
    :func:`build_prefix` makes: one tier per distinct length, longest segments first)."""
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.shape[0], device=perm.device)
    sorted_lengths = lengths[perm].tolist()
    tiers, previous, offset = [], 0, 0
    for level in sorted(set(sorted_lengths)):
        if level == 0:
            continue
        n, width = sum(1 for x in sorted_lengths if x >= level), level - previous
        size = n * width * d
        part = slice(offset, offset + size)
        tiers.append(Tier(keys[part].view(n, width, d), values[part].view(n, width, d)))
        offset, previous = offset + size, level
    return RaggedPrefix(tiers, perm, inv_perm, lengths, identity=identity)
