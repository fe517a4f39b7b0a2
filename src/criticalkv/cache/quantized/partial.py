"""Each segment's last, partial quantized block, stored at its real length.

A segment keeping ``L`` entries has ``L // G`` whole blocks (in the staircase of
:mod:`~criticalkv.cache.quantized.prefix`) and, when ``r = L mod G > 0``, one partial block of
``r`` entries. Partial blocks are stored here back to back, no padding: ``r`` entries of codes
and value statistics each, plus one key scale and zero point per channel over those ``r``
entries. Decode attention reads them at their real lengths through ``entry_starts`` of the op's
block table (:mod:`~criticalkv.cache.quantized.paged`); :meth:`PartialBlocks.as_blocks` builds the same
padding as one transient :class:`QuantizedBlocks` for readers that want whole blocks, never kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.cache.quantized.code_blocks import QuantizedBlocks
from criticalkv.cache.quantized.codec import dequantize, pack, quantize, unpack, value_group


@dataclass
class PartialBlocks:
    """The partial blocks of ``P`` segments, ``E`` entries in all (see the module docstring).

    ``rows[i]`` is the sorted-segment index of partial block ``i`` and ``lengths[i]`` its entries;
    blocks are stored in the order of ``rows`` (increasing), each block's entries in position order.
    """

    key_codes: torch.Tensor  # (E, d * bits / 8) uint8
    value_codes: torch.Tensor  # (E, d * bits / 8) uint8
    value_scale: torch.Tensor  # (E, d / Gv) float16
    value_zero: torch.Tensor  # (E, d / Gv)
    key_scale: torch.Tensor  # (P, d) float16, per channel over the block's entries
    key_zero: torch.Tensor  # (P, d)
    rows: torch.Tensor  # (P,) int64, increasing
    lengths: torch.Tensor  # (P,) int64, each in [1, G)
    num_segments: int  # rows[-1] + 1: the tile covers the first num_segments sorted segments
    width: int  # the longest partial block
    bits: int
    group: int

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The stored tensors: key codes, value codes, value scale and zero point, key scale and zero point."""
        return (self.key_codes, self.value_codes, self.value_scale, self.value_zero, self.key_scale, self.key_zero)

    def nbytes(self) -> int:
        """Codes, scales and zero points (``rows``/``lengths`` are bookkeeping, not counted)."""
        return sum(t.numel() * t.element_size() for t in self.parts())

    def _slots(self) -> torch.Tensor:
        """(E,) each entry's place in a (num_segments * width) padded layout."""
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        within = torch.arange(int(self.key_codes.shape[0]), device=self.rows.device)
        within = within - starts.repeat_interleave(self.lengths)
        return self.rows.repeat_interleave(self.lengths) * self.width + within

    def as_blocks(self) -> QuantizedBlocks:
        """A transient tile: one block of ``width`` entries for each of the first ``num_segments``
        sorted segments, padding (and segments without a partial block) masked by ``valid``."""
        n, w = self.num_segments, self.width
        slots = self._slots()

        def spread(flat: torch.Tensor) -> torch.Tensor:
            out = flat.new_zeros(n * w, *flat.shape[1:])
            return out.index_copy_(0, slots, flat).view(n, 1, w, *flat.shape[1:])

        def per_row(stat: torch.Tensor) -> torch.Tensor:
            out = stat.new_zeros(n, *stat.shape[1:])
            return out.index_copy_(0, self.rows, stat).view(n, 1, 1, -1)

        valid = torch.zeros(n * w, dtype=torch.bool, device=self.rows.device)
        valid[slots] = True
        return QuantizedBlocks(
            spread(self.key_codes),
            per_row(self.key_scale),
            per_row(self.key_zero),
            spread(self.value_codes),
            spread(self.value_scale),
            spread(self.value_zero),
            valid.view(n, w),
            self.bits,
            self.group,
        )

    def dequantize_entries(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (E, d) of every partial entry, in storage order, in ``dtype``."""
        owner = torch.arange(int(self.rows.shape[0]), device=self.rows.device).repeat_interleave(self.lengths)
        kc = unpack(self.key_codes, self.bits)
        keys = dequantize(kc, self.key_scale[owner], self.key_zero[owner], dtype)
        groups = int(self.value_scale.shape[-1])
        vc = unpack(self.value_codes, self.bits).unflatten(-1, (groups, -1))
        values = dequantize(vc, self.value_scale[..., None], self.value_zero[..., None], dtype)
        return keys, values.flatten(-2)


def quantize_partial(
    keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor, bits: int, group: int
) -> PartialBlocks:
    """Quantize (P, W, d) ``keys``/``values`` whose first ``valid.sum(-1)`` entries are real.

    ``valid`` is (P, W) bool (each row's real entries first); ``rows`` (P,) the sorted-segment
    index of each block, increasing.
    """
    p, w, d = keys.shape
    kc, ks, kz = quantize(keys, bits, dim=1, valid=valid[..., None])
    real_v = values[valid]  # (E, d) in block order, each block's entries in order
    gv = value_group(group, d)
    vc, vs, vz = quantize(real_v.reshape(-1, d // gv, gv), bits, dim=-1)
    lengths = valid.sum(-1)
    return PartialBlocks(
        pack(kc[valid], bits),
        pack(vc.flatten(-2), bits),
        vs.squeeze(-1),
        vz.squeeze(-1),
        ks.reshape(p, d),
        kz.reshape(p, d),
        rows,
        lengths,
        int(rows[-1]) + 1 if p else 0,
        w,
        bits,
        group,
    )
