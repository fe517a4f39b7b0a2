"""The quantized ragged prefix: kept prompt entries as a staircase of quantized blocks.

Like :class:`~criticalkv.cache.layouts.tiers.RaggedPrefix`, segments are sorted longest first, but the
staircase is cut in whole blocks of ``G`` entries: segment ``s`` of ``L_s`` kept entries has
``L_s // G`` whole blocks, and tier ``j`` holds blocks ``[b_{j-1}, b_j)`` of the segments with at
least ``b_j`` whole blocks. Key groups then never straddle a tier boundary, and there are at most
``max L / G`` tiers. The remaining ``L_s mod G`` entries of each segment form its partial block,
stored at its real length (:class:`~criticalkv.cache.quantized.partial.PartialBlocks`): no padded
code is stored or counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from criticalkv.cache.layouts import segment_order
from criticalkv.cache.quantized.code_blocks import QuantizedBlocks, quantize_blocks
from criticalkv.cache.quantized.partial import PartialBlocks, quantize_partial
from criticalkv.cache.quantized.pool import PrefixPool, pool


@dataclass
class QuantizedPrefix:
    """Kept entries of every segment of one layer, quantized.

    ``perm[i]`` is the segment (``b * H_kv + h``) at sorted position ``i``; ``lengths`` are per
    segment in the original order (as for :class:`~criticalkv.cache.layouts.RaggedPrefix`).
    ``block_starts[j]`` is the first block index of ``blocks[j]`` within a segment; ``partial``
    holds each segment's last ``L mod G`` entries (``None``: every segment holds whole blocks).
    After :meth:`decode_pool`, both are views of ``pool`` (the same bytes, one tensor per field).
    """

    perm: torch.Tensor  # (S,) int64
    inv_perm: torch.Tensor  # (S,) int64
    lengths: torch.Tensor  # (S,) int64
    identity: bool = False  # ``perm`` is the identity (equal lengths): no reordering needed
    blocks: list[QuantizedBlocks] = field(default_factory=list)
    block_starts: list[int] = field(default_factory=list)
    partial: PartialBlocks | None = None
    pool: PrefixPool | None = None

    def decode_pool(self) -> PrefixPool | None:
        """The stored tensors pooled field by field (done at the first call; ``None``: no entries)."""
        if self.pool is None and (self.blocks or self.partial is not None):
            self.pool, self.blocks, self.partial = pool(self.blocks, self.partial)
        return self.pool

    def nbytes(self) -> int:
        whole = sum(tier.nbytes() for tier in self.blocks)
        return whole + (0 if self.partial is None else self.partial.nbytes())

    def attention_blocks(self) -> list[QuantizedBlocks]:
        """The whole-block tiers, then the partial blocks as one transient padded tile (a reader's view)."""
        if self.partial is None:
            return self.blocks
        return [*self.blocks, self.partial.as_blocks()]

    def segment_bytes(self) -> torch.Tensor:
        """(S,) bytes each segment holds (original order): its blocks' codes, scales and zero points."""
        per_segment = torch.zeros(self.lengths.shape[0], dtype=torch.long, device=self.lengths.device)
        for tier in self.blocks:
            per_segment[self.perm[: tier.num_segments]] += tier.nbytes() // max(1, tier.num_segments)
        part = self.partial
        if part is not None and part.rows.numel():
            entries = int(part.key_codes.shape[0])
            per_entry = (part.nbytes() - part.key_scale.numel() * 2 * part.key_scale.element_size()) // entries
            per_block = 2 * part.key_scale.shape[-1] * part.key_scale.element_size()
            per_segment[self.perm[part.rows]] += part.lengths * per_entry + per_block
        return per_segment

    def dense(self, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, max L, d) dequantized keys and values of every segment in position order, original
        segment order, zero beyond a segment's length (a transient copy: decode-time re-selection)."""
        s, width = int(self.lengths.shape[0]), int(self.lengths.max()) if self.lengths.numel() else 0
        keys = torch.zeros(s, width, d, dtype=dtype, device=self.lengths.device)
        values = torch.zeros_like(keys)
        offset = 0
        for tier in self.blocks:
            k, v = tier.dequantize(0, tier.num_blocks, dtype)
            n, w = int(k.shape[0]), int(k.shape[1])
            keys[:n, offset : offset + w], values[:n, offset : offset + w] = k, v
            offset += w
        if self.partial is not None:
            part = self.partial
            k, v = part.dequantize_entries(dtype)
            rows = part.rows.repeat_interleave(part.lengths)
            whole = (self.lengths[self.perm] - self.lengths[self.perm] % part.group)[rows]
            within = torch.arange(int(k.shape[0]), device=k.device) - (
                torch.cumsum(part.lengths, 0) - part.lengths
            ).repeat_interleave(part.lengths)
            keys[rows, whole + within], values[rows, whole + within] = k, v
        if not self.identity:
            keys, values = keys[self.inv_perm], values[self.inv_perm]
        return keys, values

    @property
    def num_entries(self) -> int:
        return int(self.lengths.sum())


def build_quantized_prefix(
    keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, bits: int, group: int
) -> QuantizedPrefix:
    """Quantize the kept entries of (B, H_kv, T, d) ``keys``/``values`` (``keep``: (B, H_kv, T))."""
    b, h, t, d = keys.shape
    s = b * h
    keep_s, lengths, perm, inv_perm = segment_order(keep)
    sorted_lengths = lengths[perm]
    sorted_counts = sorted_lengths // group  # whole blocks per segment
    keys_s, values_s = keys.reshape(s, t, d), values.reshape(s, t, d)
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
        tiers.append(quantize_blocks(keys_s[rows, cols], values_s[rows, cols], bits, group))
        starts.append(previous)
        previous = level
    rest = sorted_lengths - sorted_counts * group
    partial = None
    if bool((rest > 0).any()):
        rows_p = torch.nonzero(rest > 0).flatten()  # sorted-segment indices, increasing
        width = int(rest.max())
        segs = perm[rows_p]
        index = (sorted_counts[rows_p, None] * group + torch.arange(width, device=keys.device)).clamp(max=t - 1)
        cols = positions[segs[:, None], index]
        valid = torch.arange(width, device=keys.device)[None, :] < rest[rows_p, None]
        k = keys_s[segs[:, None], cols].masked_fill(~valid[..., None], 0.0)
        v = values_s[segs[:, None], cols].masked_fill(~valid[..., None], 0.0)
        partial = quantize_partial(k, v, valid, rows_p, bits, group)
    levels = torch.unique(lengths)
    return QuantizedPrefix(
        perm, inv_perm, lengths, identity=len(levels) <= 1, blocks=tiers, block_starts=starts, partial=partial
    )
