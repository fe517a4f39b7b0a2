"""Re-selecting a compressed layer while it decodes: its entries as a :class:`LayerState`, then the
method's selection stored back as the layer's new prefix.

Every (batch row, KV head) of a compressed layer holds its own kept positions (the ragged prefix)
plus the appended tail. To let a method score them with its own code, the entries are laid out
per row on the *union* of the positions any head of that row holds, in position order and
left-padded like a prompt; :attr:`LayerState.present` marks which of them each head holds. The
last ``window`` columns of every row are its most recent entries (held by every head: the window
is always kept and every tail entry is held by every head), and the last ``window`` decode
queries act as the observation window. The layout is at most ``H_kv`` times the largest head's
entries wide, independent of how many tokens were generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from criticalkv.cache.layer import CompressedLayer
from criticalkv.cache.quantized import QuantizedLayer, QuantizedPrefix
from criticalkv.methods import Method
from criticalkv.state import LayerState


@dataclass
class UnionLayout:
    """A layer's held entries on the union of each row's positions (see the module docstring)."""

    positions: torch.Tensor  # (B, U) logical position of each column
    valid: torch.Tensor  # (B, U) bool, False on the left padding of shorter rows
    present: torch.Tensor  # (B, H_kv, U) bool, the head holds the entry
    index: torch.Tensor  # (B, H_kv, U) int64 into each segment's physical entries (prefix then tail)
    logical_len: int  # prefix_len + tail_len of the layer


def _dense_prefix(layer: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, L, d) keys and values of every segment's prefix, original segment order, zero-padded
    (a quantized prefix: dequantized)."""
    layer.settle()
    prefix = layer.prefix
    assert prefix is not None
    s, d = layer.batch_size * layer.num_kv_heads, layer.head_dim
    if isinstance(prefix, QuantizedPrefix):
        return prefix.dense(d, layer.dtype)
    width = prefix_width(layer)
    keys = torch.zeros(s, width, d, dtype=layer.dtype, device=layer.device)
    values = torch.zeros_like(keys)
    offset = 0
    for tier in prefix.tiers:
        n, w = int(tier.keys.shape[0]), int(tier.keys.shape[1])
        keys[:n, offset : offset + w], values[:n, offset : offset + w] = tier.keys, tier.values
        offset += w
    if not prefix.identity:
        keys, values = keys[prefix.inv_perm], values[prefix.inv_perm]
    return keys, values


def prefix_width(layer: CompressedLayer) -> int:
    """The longest segment's prefix entries (the width of the dense prefix)."""
    prefix = layer.prefix
    assert prefix is not None
    if isinstance(prefix, QuantizedPrefix):  # no tiers: its lengths say it
        return int(prefix.lengths.max()) if prefix.lengths.numel() else 0
    return sum(int(tier.keys.shape[1]) for tier in prefix.tiers)  # read off the shapes: no device sync


def tail_entries(layer: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, t, d) keys and values of every segment's tail, original segment order (a quantized
    layer's as held: its quantized blocks dequantized, then its exact residual)."""
    layer.settle()
    assert layer.prefix is not None
    if isinstance(layer, QuantizedLayer):
        return layer.dense_tail()
    t = layer.tail_len
    if not t or layer.tail_keys is None or layer.tail_values is None:
        empty = torch.zeros(layer.batch_size * layer.num_kv_heads, 0, layer.head_dim, dtype=layer.dtype)
        return empty.to(layer.device), empty.to(layer.device)
    tail_k, tail_v = layer.tail_keys[:, :t], layer.tail_values[:, :t]
    if not layer.prefix.identity:
        tail_k, tail_v = tail_k[layer.prefix.inv_perm], tail_v[layer.prefix.inv_perm]
    return tail_k, tail_v


def physical_entries(layer: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(S, L + t, d) keys and values of every segment (prefix, then tail) and the prefix width L."""
    keys, values = _dense_prefix(layer)
    tail_k, tail_v = tail_entries(layer)
    return torch.cat([keys, tail_k], dim=1), torch.cat([values, tail_v], dim=1), int(keys.shape[1])


def union_layout(layer: CompressedLayer, tail_valid: torch.Tensor, width: int) -> UnionLayout:
    """The union layout of ``layer``; ``tail_valid`` (B, t) marks real tail entries (not padding)."""
    assert layer.keep is not None
    b, h, t = layer.batch_size, layer.num_kv_heads, layer.tail_len
    kept = layer.keep  # (B, H, P) the prefix positions each head holds, in position order
    rank = kept.long().cumsum(-1) - 1  # index of a held prefix entry within its segment
    tail_index = width + torch.arange(t, device=kept.device)
    held = torch.cat([kept, tail_valid[:, None, :].expand(b, h, t)], dim=-1)
    index = torch.cat([rank, tail_index.expand(b, h, t)], dim=-1)
    union = held.any(dim=1)  # (B, P + t)
    columns = int(union.sum(-1).max())
    positions = torch.argsort(union.to(torch.int8), dim=-1, stable=True)[:, -columns:]  # held ones last, in order
    valid = union.gather(1, positions)
    at = positions[:, None, :].expand(b, h, columns)
    present = held.gather(2, at) & valid[:, None, :]
    return UnionLayout(positions, valid, present, index.gather(2, at).clamp(min=0), held.shape[-1])


def gather_entries(entries: torch.Tensor, layout: UnionLayout) -> torch.Tensor:
    """(S, N, ...) per-segment physical entries -> (B, H_kv, U, ...) on the union layout (0 where absent)."""
    b, h, u = layout.present.shape
    per_segment = entries.reshape(b, h, *entries.shape[1:])
    index = layout.index
    for _ in range(entries.dim() - 2):
        index = index[..., None]
    picked = per_segment.gather(2, index.expand(b, h, u, *entries.shape[2:]))
    mask = layout.present
    for _ in range(entries.dim() - 2):
        mask = mask[..., None]
    return picked * mask


@dataclass
class Reselection:
    """The result of one decode-time re-selection of a layer."""

    keep: torch.Tensor  # (B, H_kv, U) bool on the union layout
    norms: torch.Tensor | None  # (S, L') projected value norms of the new prefix, segment order


def reselect(
    layer: CompressedLayer,
    method: Method,
    budget: int,
    *,
    queries: torch.Tensor,
    tail_valid: torch.Tensor,
    module: Any,
    window: int,
    num_layers: int,
    norms: torch.Tensor | None = None,
    norms_key: Any = None,
) -> Reselection:
    """Re-select ``layer`` to ``budget`` entries per KV head on average (the method's own budget rule)
    and store the kept entries as its new prefix, in position order; the tail becomes empty.

    ``queries`` (B, H_q, window, d) are the most recent queries; ``norms`` (S, L + t) the projected
    value norms of the physical entries (memoised for the selection under ``norms_key``).
    """
    keys, values, width = physical_entries(layer)
    layout = union_layout(layer, tail_valid, width)
    memo: dict[Any, torch.Tensor] = {}
    if norms is not None:
        memo[norms_key] = gather_entries(norms, layout)
    state = LayerState(
        queries=queries,
        keys=gather_entries(keys, layout),
        values=gather_entries(values, layout),
        valid=layout.valid,
        module=module,
        window=window,
        layer_idx=layer.layer_idx,
        num_layers=num_layers,
        memo=memo,
        present=layout.present,
    )
    per_row = torch.clamp(state.lengths, max=budget)  # a row holding less keeps all of it
    keep = method.keep_mask(state, per_row) & layout.present
    layer.set_prefix(state.keys, state.values, keep, logical_len=layout.logical_len)
    logical = torch.zeros(*keep.shape[:2], layout.logical_len, dtype=torch.bool, device=keep.device)
    layer.keep = logical.scatter_(2, layout.positions[:, None, :].expand_as(keep), keep)
    new_norms = None if norms is None else kept_in_order(memo[norms_key], keep, layer)
    return Reselection(keep, new_norms)


def kept_in_order(per_entry: torch.Tensor, keep: torch.Tensor, layer: CompressedLayer) -> torch.Tensor:
    """(S, L) the (B, H_kv, T) ``per_entry`` values of each segment's kept entries, in position order
    (``L`` the layer's longest segment; zero beyond a segment's length)."""
    assert layer.prefix is not None
    s, t = keep.shape[0] * keep.shape[1], keep.shape[-1]
    width = prefix_width(layer)
    keep_s = keep.reshape(s, t)
    order = torch.argsort((~keep_s).to(torch.int8), dim=-1, stable=True)[:, :width]
    picked = per_entry.reshape(s, t).gather(1, order)
    return picked * keep_s.gather(1, order)
