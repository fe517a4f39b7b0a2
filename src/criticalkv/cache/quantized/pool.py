"""A quantized prefix's stored tensors, each field one contiguous tensor that decode gathers from.

The staircase tiers and the partial blocks (:mod:`~criticalkv.cache.quantized.prefix`) are
separate tensors. Decode attention (``torch.ops.criticalkv.ragged_decode``) reads one pool per
field through a block table, so the prefix is *pooled* once: each field's tiers and partial
blocks are concatenated into one tensor, entries (codes, value statistics) in one, blocks (key
statistics) in another, and the tiers and partial blocks are replaced by views of it. The stored
bytes are the same (nothing is kept twice), and everything that reads the tiers (saving,
re-selection, the references) reads the views unchanged. A decode step then reads any segment's
entries from one tensor per field (:mod:`~criticalkv.cache.quantized.paged` builds the table).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from criticalkv.cache.quantized.code_blocks import QuantizedBlocks
from criticalkv.cache.quantized.partial import PartialBlocks


@dataclass(frozen=True)
class PrefixPool:
    """One tensor per field: entry rows (tier ``j``'s entries from ``entry_starts[j]``, the partial
    blocks' from ``entry_starts[-1]``) and block rows (``block_starts`` likewise)."""

    key_codes: torch.Tensor  # (E, d * bits / 8) uint8
    value_codes: torch.Tensor  # (E, d * bits / 8) uint8
    value_scale: torch.Tensor  # (E, d / Gv) float16
    value_zero: torch.Tensor  # (E, d / Gv)
    key_scale: torch.Tensor  # (NB, d) float16
    key_zero: torch.Tensor  # (NB, d)
    entry_starts: list[int]  # len(tiers) + 1
    block_starts: list[int]  # len(tiers) + 1


#: the fields indexed by entry, then the fields indexed by block
ENTRY_FIELDS = ("key_codes", "value_codes", "value_scale", "value_zero")
BLOCK_FIELDS = ("key_scale", "key_zero")


def pool(
    tiers: list[QuantizedBlocks], partial: PartialBlocks | None
) -> tuple[PrefixPool, list[QuantizedBlocks], PartialBlocks | None]:
    """Concatenate ``tiers`` and ``partial`` field by field; returns the pool and the tiers and
    partial blocks as views of it (the inputs' tensors are no longer needed)."""
    entry_starts, block_starts = [0], [0]
    for tier in tiers:
        blocks = tier.num_segments * tier.num_blocks
        entry_starts.append(entry_starts[-1] + blocks * tier.group)
        block_starts.append(block_starts[-1] + blocks)
    sources: list[QuantizedBlocks | PartialBlocks] = [*tiers, *([] if partial is None else [partial])]
    pooled: dict[str, torch.Tensor] = {}
    for name in ENTRY_FIELDS + BLOCK_FIELDS:
        width = int(getattr(sources[0], name).shape[-1])
        pooled[name] = torch.cat([getattr(source, name).reshape(-1, width) for source in sources])
    out = PrefixPool(**pooled, entry_starts=entry_starts, block_starts=block_starts)

    def views(source: QuantizedBlocks | PartialBlocks, entries: slice, blocks: slice) -> dict[str, Any]:
        fields = {name: pooled[name][entries] for name in ENTRY_FIELDS}
        fields.update({name: pooled[name][blocks] for name in BLOCK_FIELDS})
        return {name: t.view(getattr(source, name).shape) for name, t in fields.items()}

    tier_views = [
        replace(
            tier,
            **views(tier, slice(entry_starts[j], entry_starts[j + 1]), slice(block_starts[j], block_starts[j + 1])),
        )
        for j, tier in enumerate(tiers)
    ]
    part_view = None
    if partial is not None:
        part_view = replace(partial, **views(partial, slice(entry_starts[-1], None), slice(block_starts[-1], None)))
    return out, tier_views, part_view
