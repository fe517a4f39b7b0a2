"""Saving and restoring a quantized layer's storage (used by :mod:`~criticalkv.cache.persist.file`).

A quantized layer's file tensors are its stored bytes and nothing else: the whole-block tiers'
codes, scales and zero points (each field's tiers concatenated), the partial blocks' (at their real
length), the quantized tail's blocks in use and the full-precision residual's used entries. The
tier shapes follow from the segment lengths and the group size, so only the capacities (spare
room of the tail and residual) go to the header.
"""

from __future__ import annotations

from typing import Any

import torch

from criticalkv.cache.quantized.blocks import QuantizedBlocks, empty_blocks, write_blocks
from criticalkv.cache.quantized.codec import value_group
from criticalkv.cache.quantized.layer import QuantizedLayer
from criticalkv.cache.quantized.partial import PartialBlocks
from criticalkv.cache.quantized.prefix import QuantizedPrefix

BLOCK_FIELDS = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")
PARTIAL_FIELDS = ("key_codes", "value_codes", "value_scale", "value_zero", "key_scale", "key_zero")


def quantized_tensors(layer: QuantizedLayer) -> dict[str, torch.Tensor]:
    """The layer's stored tensors, named ``q.<part>.<field>`` (flattened)."""
    prefix = layer.prefix
    assert isinstance(prefix, QuantizedPrefix)
    out: dict[str, torch.Tensor] = {}
    for k, name in enumerate(BLOCK_FIELDS):
        flat = [tier.parts()[k].reshape(-1) for tier in prefix.blocks]
        if flat:
            out[f"q.prefix.{name}"] = torch.cat(flat)
    if prefix.partial is not None:
        for name, tensor in zip(PARTIAL_FIELDS, prefix.partial.parts(), strict=True):
            out[f"q.partial.{name}"] = tensor.reshape(-1)
    if layer.tail_blocks is not None and layer.tail_used:
        for name, tensor in zip(BLOCK_FIELDS, layer.tail_blocks.parts(), strict=True):
            out[f"q.tail.{name}"] = tensor[:, : layer.tail_used].contiguous()
    if layer.residual_keys is not None and layer.residual_values is not None and layer.residual_len:
        out["q.residual_keys"] = layer.residual_keys[:, : layer.residual_len]
        out["q.residual_values"] = layer.residual_values[:, : layer.residual_len]
    return out


def quantized_header(layer: QuantizedLayer) -> dict[str, Any]:
    """What restoring the layer needs beyond its tensors: the residual in effect and the capacities."""
    return {
        "residual": layer.residual,
        "tail_used": layer.tail_used,
        "tail_block_capacity": 0 if layer.tail_blocks is None else layer.tail_blocks.num_blocks,
        "residual_len": layer.residual_len,
        "residual_capacity": 0 if layer.residual_keys is None else int(layer.residual_keys.shape[1]),
    }


def _block_shapes(n: int, nb: int, group: int, d: int, bits: int) -> list[tuple[int, ...]]:
    """The shapes of :data:`BLOCK_FIELDS` for ``n`` segments of ``nb`` blocks."""
    width, groups = d * bits // 8, d // value_group(group, d)
    codes, key_stat, value_stat = (n, nb, group, width), (n, nb, 1, d), (n, nb, group, groups)
    return [codes, key_stat, key_stat, codes, value_stat, value_stat]


def _blocks(parts: list[torch.Tensor], bits: int, group: int) -> QuantizedBlocks:
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
    """The :class:`QuantizedPrefix` whose tensors :func:`quantized_tensors` wrote (``t``: this layer's)."""
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
    blocks = [_blocks([field[j] for field in per_field], bits, group) for j in range(len(levels))]
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
        [],
        perm,
        inv_perm,
        lengths,
        identity=identity,
        blocks=blocks,
        block_starts=starts[: len(blocks)],
        partial=partial,
    )


def restore_tail(layer: QuantizedLayer, info: dict[str, Any], t: dict[str, torch.Tensor], where: torch.device) -> None:
    """The quantized tail and the residual of ``layer`` (its prefix and shape already set), capacities kept."""
    spec, s = layer.spec, layer.batch_size * layer.num_kv_heads
    layer.residual = info["residual"]
    if info["tail_block_capacity"]:
        layer.tail_blocks = empty_blocks(
            s, info["tail_block_capacity"], layer.head_dim, spec.bits, spec.group_size, where
        )
        if info["tail_used"]:
            saved = [t[f"q.tail.{name}"].to(where) for name in BLOCK_FIELDS]
            write_blocks(layer.tail_blocks, 0, _blocks(saved, spec.bits, spec.group_size))
        layer.tail_used = info["tail_used"]
    if info["residual_capacity"]:
        layer._grow_residual(info["residual_capacity"])
        assert layer.residual_keys is not None and layer.residual_values is not None
        r = info["residual_len"]
        if r:
            layer.residual_keys[:, :r] = t["q.residual_keys"].to(where)
            layer.residual_values[:, :r] = t["q.residual_values"].to(where)
        layer.residual_len = r
