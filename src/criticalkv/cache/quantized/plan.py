"""Where each decode tile's entries come from: the gather indices into a pooled quantized prefix.

A *tile* is a run of consecutive (sorted) segments. In its workspace every segment has the same
number of *slots*: ``nbp`` prefix blocks of ``G`` entries (its whole blocks, then its partial
block, padded to ``G``, then padding up to the longest segment of the tile), then the
quantized tail's ``used`` blocks, then the full-precision residual. The plan holds, per tile, the
pool rows of every prefix slot (entries and blocks; padding reads row 0) and an additive mask
(0 or ``-inf``) over the slots and room for the residual. Plans are bookkeeping only: indices
and masks, rebuilt when the quantized tail gains a block or the residual outgrows the mask.
Tiles are cut so that their padded slots hold at most :data:`TILE_BLOCKS` blocks (or one
segment): the workspace is bounded by a tile, never the whole layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.cache.quantized.pool import PrefixPool
from criticalkv.cache.quantized.prefix import QuantizedPrefix

#: blocks (padded prefix slots and quantized tail, of whole segments) in one tile's workspace
TILE_BLOCKS = 128


@dataclass(frozen=True)
class Tile:
    """Sorted segments ``[first, last)``, ``nbp`` prefix blocks a segment (see the module docstring)."""

    first: int
    last: int
    nbp: int
    entry_rows: torch.Tensor  # (n * nbp * G,) int64 pool entry rows
    block_rows: torch.Tensor  # (n * nbp,) int64 pool block rows
    bias: torch.Tensor  # (n, 1, (nbp + used) * G + room) float32: 0 = real entry, -inf = padding
    has_empty: bool  # some segment holds no quantized entry (its row may have nothing to attend to)


@dataclass(frozen=True)
class DecodePlan:
    """The tiles of one layer for ``tail_used`` quantized tail blocks and ``room`` residual columns."""

    tiles: list[Tile]
    tail_used: int
    room: int


def _segment_rows(
    prefix: QuantizedPrefix, pool: PrefixPool | None, group: int
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per sorted segment: its pool entry rows, block rows and real entries, in slot order."""
    device = prefix.lengths.device
    s = int(prefix.lengths.shape[0])
    if pool is None:  # nothing stored
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return [(empty, empty, 0) for _ in range(s)]
    entries: list[list[torch.Tensor]] = [[] for _ in range(s)]
    blocks: list[list[torch.Tensor]] = [[] for _ in range(s)]
    for j, tier in enumerate(prefix.blocks):
        nb = tier.num_blocks
        for i in range(tier.num_segments):
            e0 = pool.entry_starts[j] + i * nb * group
            entries[i].append(torch.arange(e0, e0 + nb * group, device=device))
            b0 = pool.block_starts[j] + i * nb
            blocks[i].append(torch.arange(b0, b0 + nb, device=device))
    reals = [sum(int(t.shape[0]) for t in rows) for rows in entries]
    part = prefix.partial
    if part is not None:
        starts = (torch.cumsum(part.lengths, 0) - part.lengths).tolist()
        for k, (row, length) in enumerate(zip(part.rows.tolist(), part.lengths.tolist(), strict=True)):
            e0 = pool.entry_starts[-1] + starts[k]
            pad = torch.zeros(group - length, dtype=torch.long, device=device)
            entries[row].append(torch.cat([torch.arange(e0, e0 + length, device=device), pad]))
            blocks[row].append(torch.tensor([pool.block_starts[-1] + k], device=device))
            reals[row] += length
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return [
        (torch.cat(e) if e else empty, torch.cat(b) if b else empty, real)
        for e, b, real in zip(entries, blocks, reals, strict=True)
    ]


def plan(prefix: QuantizedPrefix, pool: PrefixPool | None, group: int, tail_used: int, room: int) -> DecodePlan:
    """The tiles of ``prefix`` (pooled as ``pool``) with ``tail_used`` tail blocks and ``room``
    residual columns (see the module docstring)."""
    rows = _segment_rows(prefix, pool, group)
    device = prefix.lengths.device
    tiles, first, count = [], 0, len(rows)
    while first < count:
        nbp = int(rows[first][1].shape[0])  # sorted longest first: the tile's widest segment
        last = first + 1
        while last < count and (last + 1 - first) * (nbp + tail_used) <= TILE_BLOCKS:
            last += 1
        n, slots = last - first, nbp * group
        entry_rows = torch.zeros(n, slots, dtype=torch.long, device=device)
        block_rows = torch.zeros(n, nbp, dtype=torch.long, device=device)
        bias = torch.zeros(n, 1, slots + tail_used * group + room, device=device)
        for i in range(n):
            e, b, real = rows[first + i]
            entry_rows[i, : e.shape[0]] = e
            block_rows[i, : b.shape[0]] = b
            bias[i, 0, real:slots] = float("-inf")  # whole blocks, then the partial block: real entries first
        has_empty = tail_used == 0 and any(rows[first + i][2] == 0 for i in range(n))
        tiles.append(Tile(first, last, nbp, entry_rows.reshape(-1), block_rows.reshape(-1), bias, has_empty))
        first = last
    return DecodePlan(tiles, tail_used, room)
