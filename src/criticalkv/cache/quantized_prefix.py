"""The quantized ragged prefix: kept prompt entries as a staircase of quantized blocks.

Like :class:`~criticalkv.cache.tiers.RaggedPrefix`, segments are sorted longest first, but the
staircase is cut in whole blocks of ``G`` entries: segment ``s`` of ``L_s`` kept entries has
``ceil(L_s / G)`` blocks (the last one partial, its padding masked), and tier ``j`` holds blocks
``[b_{j-1}, b_j)`` of the segments with at least ``b_j`` blocks. Key groups then never straddle a
tier boundary, and there are at most ``ceil(max L / G)`` tiers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from criticalkv.cache.quantized_store import QuantizedBlocks, quantize_blocks
from criticalkv.cache.tiers import RaggedPrefix, segment_order


@dataclass
class QuantizedPrefix(RaggedPrefix):
    """A :class:`RaggedPrefix` whose entries live in ``blocks`` (its ``tiers`` are empty).

    ``block_starts[j]`` is the first block index of ``blocks[j]`` within a segment.
    """

    blocks: list[QuantizedBlocks] = field(default_factory=list)
    block_starts: list[int] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(tier.nbytes() for tier in self.blocks)

    def segment_bytes(self) -> torch.Tensor:
        """(S,) bytes each segment holds (original order): its blocks' codes, scales and zero points."""
        per_segment = torch.zeros(self.lengths.shape[0], dtype=torch.long, device=self.lengths.device)
        for tier in self.blocks:
            per_segment[self.perm[: tier.num_segments]] += tier.nbytes() // max(1, tier.num_segments)
        return per_segment

    def segment(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError("a quantized prefix cannot be read back per segment in full precision")


def build_quantized_prefix(
    keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, bits: int, group: int
) -> QuantizedPrefix:
    """Quantize the kept entries of (B, H_kv, T, d) ``keys``/``values`` (``keep``: (B, H_kv, T))."""
    b, h, t, d = keys.shape
    s = b * h
    keep_s, lengths, perm, inv_perm = segment_order(keep)
    counts = (lengths + group - 1) // group  # blocks per segment
    sorted_counts = counts[perm]
    longest = int(sorted_counts[0]) * group if s else 0
    pad = max(0, longest - t)
    keys_s, values_s = keys.reshape(s, t, d), values.reshape(s, t, d)
    if pad:
        keys_s = torch.cat([keys_s, keys_s.new_zeros(s, pad, d)], dim=1)
        values_s = torch.cat([values_s, values_s.new_zeros(s, pad, d)], dim=1)
        keep_s = torch.cat([keep_s, keep_s.new_zeros(s, pad)], dim=1)
    positions = torch.argsort((~keep_s).to(torch.int8), dim=-1, stable=True)  # kept first, in order
    tiers: list[QuantizedBlocks] = []
    starts: list[int] = []
    previous = 0
    for level in torch.unique(sorted_counts).tolist():
        if level == 0:
            continue
        n = int((sorted_counts >= level).sum())
        rows = perm[:n, None]
        cols = positions[rows[:, 0], previous * group : level * group]
        index = torch.arange(previous * group, level * group, device=keys.device)
        valid = index[None, :] < lengths[perm[:n], None]
        k = keys_s[rows, cols].masked_fill(~valid[..., None], 0.0)
        v = values_s[rows, cols].masked_fill(~valid[..., None], 0.0)
        tiers.append(quantize_blocks(k, v, bits, group, valid))
        starts.append(previous)
        previous = level
    levels = torch.unique(lengths)
    return QuantizedPrefix([], perm, inv_perm, lengths, identity=len(levels) <= 1, blocks=tiers, block_starts=starts)
