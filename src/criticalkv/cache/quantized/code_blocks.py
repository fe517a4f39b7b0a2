"""Quantized blocks: ``group_size`` consecutive entries of some segments, keys and values packed.

A block holds ``G = group_size`` entries of one segment (a (batch row, KV head)). Its keys are
quantized per channel over the block's entries, its values per token over groups of
``min(G, d)`` channels (KIVI's grouping). :class:`QuantizedBlocks` stores ``n`` segments times ``nb`` blocks
as dense tensors, so a range of blocks dequantizes in one batched step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.cache.quantized.codec import SCALE_DTYPE, dequantize, pack, quantize, unpack, value_group


@dataclass
class QuantizedBlocks:
    """``n`` segments x ``nb`` blocks of ``group`` entries each.

    ``valid`` is (n, nb * group) bool, or ``None`` when every entry is real (a transient tile of
    partial blocks, :meth:`~criticalkv.cache.quantized.partial.PartialBlocks.as_blocks`, holds
    fewer than ``group`` entries per block and masks its padding).
    """

    key_codes: torch.Tensor  # (n, nb, G, d * bits / 8) uint8
    key_scale: torch.Tensor  # (n, nb, 1, d) float16
    key_zero: torch.Tensor  # (n, nb, 1, d)
    value_codes: torch.Tensor  # (n, nb, G, d * bits / 8) uint8
    value_scale: torch.Tensor  # (n, nb, G, d / Gv) float16, Gv = min(G, d)
    value_zero: torch.Tensor  # (n, nb, G, d / Gv)
    valid: torch.Tensor | None
    bits: int
    group: int

    @property
    def num_segments(self) -> int:
        return int(self.key_codes.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.key_codes.shape[1])

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The stored tensors: key codes, scale, zero point, value codes, scale, zero point."""
        return (self.key_codes, self.key_scale, self.key_zero, self.value_codes, self.value_scale, self.value_zero)

    def nbytes(self) -> int:
        """Packed codes, scales and zero points (the validity mask is bookkeeping, not counted)."""
        return sum(t.numel() * t.element_size() for t in self.parts())

    def dequantize(self, start: int, stop: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (n, (stop - start) * G, d) of blocks ``[start, stop)``, in ``dtype``."""
        n = self.num_segments
        kc = unpack(self.key_codes[:, start:stop], self.bits)  # (n, w, G, d)
        d = int(kc.shape[-1])
        keys = dequantize(kc, self.key_scale[:, start:stop], self.key_zero[:, start:stop], dtype)
        groups = int(self.value_scale.shape[-1])
        vc = unpack(self.value_codes[:, start:stop], self.bits).unflatten(-1, (groups, d // groups))
        values = dequantize(
            vc, self.value_scale[:, start:stop, ..., None], self.value_zero[:, start:stop, ..., None], dtype
        )
        return keys.reshape(n, -1, d), values.reshape(n, -1, d)

    def valid_columns(self, start: int, stop: int) -> torch.Tensor | None:
        """(n, (stop - start) * G) bool of real entries in blocks ``[start, stop)``, or ``None``: all real."""
        if self.valid is None:
            return None
        return self.valid[:, start * self.group : stop * self.group]


def quantize_blocks(
    keys: torch.Tensor, values: torch.Tensor, bits: int, group: int, valid: torch.Tensor | None = None
) -> QuantizedBlocks:
    """Quantize (n, nb * G, d) ``keys``/``values`` into blocks of ``G = group`` entries.

    ``valid`` is (n, nb * G) bool (``None``: all real); invalid entries do not enter the key statistics.
    """
    n, total, d = keys.shape
    if total % group:
        raise ValueError(f"{total} entries are not whole blocks of {group}")
    nb = total // group
    k = keys.reshape(n, nb, group, d)
    key_valid = None if valid is None else valid.reshape(n, nb, group, 1)
    kc, ks, kz = quantize(k, bits, dim=2, valid=key_valid)
    gv = value_group(group, d)
    v = values.reshape(n, nb, group, d // gv, gv)
    vc, vs, vz = quantize(v, bits, dim=-1)
    return QuantizedBlocks(
        pack(kc, bits),
        ks,
        kz,
        pack(vc.flatten(-2), bits),
        vs.squeeze(-1),
        vz.squeeze(-1),
        None if valid is None or bool(valid.all()) else valid,
        bits,
        group,
    )


def empty_blocks(n: int, capacity: int, d: int, bits: int, group: int, device: torch.device) -> QuantizedBlocks:
    """Room for ``capacity`` blocks per segment, all real entries (the quantized decode tail)."""
    width = d * bits // 8
    codes = torch.zeros(n, capacity, group, width, dtype=torch.uint8, device=device)
    key_stat = torch.zeros(n, capacity, 1, d, dtype=SCALE_DTYPE, device=device)
    value_stat = torch.zeros(n, capacity, group, d // value_group(group, d), dtype=SCALE_DTYPE, device=device)
    return QuantizedBlocks(
        codes, key_stat, key_stat.clone(), codes.clone(), value_stat, value_stat.clone(), None, bits, group
    )


def write_blocks(target: QuantizedBlocks, at: int, source: QuantizedBlocks) -> None:
    """Copy ``source``'s blocks into ``target`` from block ``at`` on (both all real)."""
    stop = at + source.num_blocks
    target.key_codes[:, at:stop] = source.key_codes
    target.key_scale[:, at:stop] = source.key_scale
    target.key_zero[:, at:stop] = source.key_zero
    target.value_codes[:, at:stop] = source.value_codes
    target.value_scale[:, at:stop] = source.value_scale
    target.value_zero[:, at:stop] = source.value_zero
