"""Asymmetric group quantization and 4-bit packing, the primitives of the quantized cache.

A group of values ``x`` is stored as integer codes ``c = round((x - z) / s)`` in ``[0, 2^b - 1]``
with a scale ``s`` and a zero point ``z`` per group, both float16; ``x ~= c * s + z``. The zero
point is ``min(x)`` rounded *down* and the scale ``(max(x) - z) / (2^b - 1)`` rounded *up* to
float16, so no code is clipped and every value is within ``s / 2`` of its reconstruction.
KIVI (Liu et al. 2024, arXiv 2402.02750) groups keys per channel and values per token; the
grouping is the caller's choice of ``dim`` here. 4-bit codes are packed two per byte.
"""

from __future__ import annotations

import torch

#: storage precisions a cache may be quantized to (16: not quantized)
SUPPORTED_BITS: tuple[int, ...] = (4, 8)
#: what scales and zero points are stored in
SCALE_DTYPE = torch.float16


def value_group(group: int, head_dim: int) -> int:
    """Channels per value group: ``group``, or the whole head when ``group`` is at least ``head_dim``."""
    return min(group, head_dim)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (..., d) of ``bits`` bits: 8 -> unchanged, 4 -> (..., d / 2), even index low."""
    if bits == 8:
        return codes
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit packing needs an even last dimension, not {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack`: uint8 codes (..., d)."""
    if bits == 8:
        return packed
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _toward(x: torch.Tensor, direction: float) -> torch.Tensor:
    """``x`` (float32) as float16, rounded toward ``direction`` (+inf: up, -inf: down)."""
    rounded = x.to(SCALE_DTYPE)
    wrong = rounded.float() > x if direction < 0 else rounded.float() < x
    stepped = torch.nextafter(rounded, torch.full_like(rounded, direction))
    return torch.where(wrong, stepped, rounded)


def quantize(
    x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` in groups that span dimension ``dim`` (every other index is its own group).

    Parameters
    ----------
    x : values to quantize (any float dtype).
    bits : 4 or 8.
    dim : the dimension a group runs along (``-1``: groups of the last dimension).
    valid : optional bool mask broadcastable to ``x``; entries outside it are ignored by the
        group statistics (their codes are clipped into range).

    Returns
    -------
    ``(codes, scale, zero)``: uint8 codes shaped like ``x`` (unpacked), float16 scale and zero
    point with ``dim`` kept as size 1.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, not {bits}")
    levels = 2**bits - 1
    xf = x.float()
    if valid is None:
        low, high = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    else:
        low = xf.masked_fill(~valid, float("inf")).amin(dim, keepdim=True)
        high = xf.masked_fill(~valid, float("-inf")).amax(dim, keepdim=True)
        empty = torch.isinf(low)  # a group with no valid entry: any finite statistics do
        low, high = low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    zero = _toward(low, float("-inf"))
    scale = _toward((high - zero.float()) / levels, float("inf"))
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if not (torch.isfinite(scale).all() and torch.isfinite(zero).all()):
        raise ValueError(
            "the keys or values exceed float16's range, so they cannot be quantized with float16 scales: use kv_bits=16"
        )
    codes = torch.round((xf - zero.float()) / scale.float()).clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale + zero`` computed in float32, returned in ``dtype``."""
    return (codes.float() * scale.float() + zero.float()).to(dtype)
