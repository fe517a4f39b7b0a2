"""The tensors of a quantized prefix in a cache file (:class:`~criticalkv.cache.quantized.storage.QuantizedStorage`
writes its tail's beside them).

A quantized layer's file tensors are its stored bytes and nothing else: the whole-block tiers'
codes, scales and zero points (each field's tiers concatenated), the partial blocks' (at their real
length), the quantized tail's blocks in use and the full-precision residual's used entries. The
tier shapes follow from the segment lengths and the group size, so only the capacities (spare
room of the tail and residual) go to the header.
"""

from __future__ import annotations

import torch

from criticalkv.cache.quantized.code_blocks import QuantizedBlocks
from criticalkv.cache.quantized.codec import value_group
from criticalkv.cache.quantized.partial import PartialBlocks
from criticalkv.cache.quantized.prefix import QuantizedPrefix

BLOCK_FIELDS = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")
PARTIAL_FIELDS = ("key_codes", "value_codes", "value_scale", "value_zero", "key_scale", "key_zero")


def prefix_tensors(prefix: QuantizedPrefix) -> dict[str, torch.Tensor]:
    """The prefix's stored tensors, named ``q.prefix.<field>`` and ``q.partial.<field>`` (flattened)."""
    out: dict[str, torch.Tensor] = {}
    for k, name in enumerate(BLOCK_FIELDS):
        flat = [tier.parts()[k].reshape(-1) for tier in prefix.blocks]
        if flat:
            out[f"q.prefix.{name}"] = torch.cat(flat)
    if prefix.partial is not None:
        for name, tensor in zip(PARTIAL_FIELDS, prefix.partial.parts(), strict=True):
            out[f"q.partial.{name}"] = tensor.reshape(-1)
    return out


def _block_shapes(n: int, nb: int, group: int, d: int, bits: int) -> list[tuple[int, ...]]:
    """The shapes of :data:`BLOCK_FIELDS` for ``n`` segments of ``nb`` blocks."""
    width, groups = d * bits // 8, d // value_group(group, d)
    codes, key_stat, value_stat = (n, nb, group, width), (n, nb, 1, d), (n, nb, group, groups)
    return [codes, key_stat, key_stat, codes, value_stat, value_stat]


def as_blocks(parts: list[torch.Tensor], bits: int, group: int) -> QuantizedBlocks:
    return QuantizedBlocks(parts[0], parts[1], parts[2], parts[3], parts[4], parts[5], None, bits, group)


def _split(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    if sum(sizes) != flat.numel():
        raise ValueError(
            f"a stored quantized tensor holds {flat.numel()} elements, not the {sum(sizes)} its header implies"
        )
    return [part.view(shape) for part, shape in zip(torch.split(flat, sizes), shapes, strict=True)]


def restore_prefix(
    t: dict[str, torch.Tensor], perm: torch.Tensor, lengths: torch.Tensor, identity: bool, d: int, bits: int, group: int
) -> QuantizedPrefix:
    """The :class:`QuantizedPrefix` whose tensors :func:`prefix_tensors` wrote (``t``: this layer's)."""
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.shape[0], device=perm.device)
    sorted_lengths = lengths[perm]
    counts = sorted_lengths // group
    levels = [level for level in torch.unique(counts).tolist() if level]
    shapes: list[list[tuple[int, ...]]] = []
    previous = 0
    for level in levels:
        shapes.append(_block_shapes(int((counts >= level).sum()), level - previous, group, d, bits))
        previous = level
    per_field = [
        _split(t[f"q.prefix.{name}"], [tier[k] for tier in shapes]) if shapes else []
        for k, name in enumerate(BLOCK_FIELDS)
    ]
    blocks = [as_blocks([field[j] for field in per_field], bits, group) for j in range(len(levels))]
    starts = [0, *levels[:-1]]
    partial = None
    rest = sorted_lengths - counts * group
    if bool((rest > 0).any()):
        rows = torch.nonzero(rest > 0).flatten()
        sizes = rest[rows]
        e, p = int(sizes.sum()), int(rows.shape[0])
        width, groups = d * bits // 8, d // value_group(group, d)
        dims = {
            "key_codes": (e, width),
            "value_codes": (e, width),
            "value_scale": (e, groups),
            "value_zero": (e, groups),
        }
        kc, vc, vs, vz, ks, kz = (t[f"q.partial.{name}"].view(dims.get(name, (p, d))) for name in PARTIAL_FIELDS)
        partial = PartialBlocks(kc, vc, vs, vz, ks, kz, rows, sizes, int(rows[-1]) + 1, int(sizes.max()), bits, group)
    return QuantizedPrefix(
        perm,
        inv_perm,
        lengths,
        identity=identity,
        blocks=blocks,
        block_starts=starts[: len(blocks)],
        partial=partial,
    )
