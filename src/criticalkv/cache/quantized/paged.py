"""A quantized prefix as the paged layout of ``torch.ops.criticalkv.ragged_decode``.

The pooled prefix (:mod:`~criticalkv.cache.quantized.pool`) already holds every field in one
tensor: whole blocks of ``G`` entries (tier ``j``'s block ``b`` at entry rows ``b * G``), then
the partial blocks at their real lengths. The block table lists each sorted segment's blocks in
slot order (whole, then its partial block); ``entry_starts`` says where each block's entries
begin (partial blocks are stored unpadded). Built once per prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.cache.quantized.pool import PrefixPool
from criticalkv.cache.quantized.prefix import QuantizedPrefix


@dataclass(frozen=True)
class PagedQuantized:
    """Block table (S, M) int32 (-1 past a segment's blocks), entries per segment (S,) int32 and
    the first entry row of every pool block (NB,) int32; segments in sorted order."""

    table: torch.Tensor
    lengths: torch.Tensor
    entry_starts: torch.Tensor


def paged_quantized(prefix: QuantizedPrefix, pool: PrefixPool | None, group: int) -> PagedQuantized:
    """The paged view of ``prefix`` pooled as ``pool`` (``None``: nothing stored)."""
    device = prefix.lengths.device
    s = int(prefix.lengths.shape[0])
    sorted_lengths = (prefix.lengths if prefix.identity else prefix.lengths[prefix.perm]).to(torch.int32)
    if pool is None:
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return PagedQuantized(torch.full((s, 1), -1, dtype=torch.int32, device=device), sorted_lengths, empty)
    blocks: list[list[torch.Tensor]] = [[] for _ in range(s)]
    for j, tier in enumerate(prefix.blocks):
        nb = tier.num_blocks
        first = pool.block_starts[j] + torch.arange(tier.num_segments, device=device)[:, None] * nb
        rows = first + torch.arange(nb, device=device)
        for i in range(tier.num_segments):
            blocks[i].append(rows[i])
    whole = pool.block_starts[len(prefix.blocks)]
    starts = torch.arange(whole, device=device) * group
    part = prefix.partial
    if part is not None:
        offsets = torch.cumsum(part.lengths, 0) - part.lengths
        starts = torch.cat([starts, pool.entry_starts[-1] + offsets])
        for k, row in enumerate(part.rows.tolist()):
            blocks[row].append(torch.tensor([whole + k], device=device))
    width = max([1, *(sum(int(b.shape[0]) for b in row) for row in blocks)])
    table = torch.full((s, width), -1, dtype=torch.int32, device=device)
    for i, row in enumerate(blocks):
        if row:
            ids = torch.cat(row)
            table[i, : ids.shape[0]] = ids.to(torch.int32)
    return PagedQuantized(table, sorted_lengths, starts.to(torch.int32))
