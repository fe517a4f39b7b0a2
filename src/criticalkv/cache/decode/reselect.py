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


def tail_entries(layer: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, t, d) keys and values of every segment's tail, original segment order (as held: quantized
    storage's blocks dequantized, then its exact residual)."""
    return layer.storage.dense_tail()


def physical_entries(layer: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(S, L + t, d) keys and values of every segment (prefix, then tail) and the prefix width L."""
    keys, values = layer.storage.dense_prefix()
    tail_k, tail_v = layer.storage.dense_tail()
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
    budget: int | torch.Tensor,
    *,
    queries: torch.Tensor,
    tail_valid: torch.Tensor,
    module: Any,
    window: int,
    num_layers: int,
    norms: torch.Tensor | None = None,
    norms_key: Any = None,
) -> Reselection:
    """Re-select ``layer`` to ``budget`` entries per KV head on average (an int, or (B,) one per batch
    row; the method's own budget rule) and store the kept entries as its new prefix, in position
    order; the tail becomes empty.

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
    cap = torch.as_tensor(budget, device=state.lengths.device)
    per_row = torch.minimum(state.lengths, cap)  # a row holding less keeps all of it
    keep = method.keep_mask(state, per_row) & layout.present
    layer.set_prefix(state.keys, state.values, keep, logical_len=layout.logical_len)
    logical = torch.zeros(*keep.shape[:2], layout.logical_len, dtype=torch.bool, device=keep.device)
    layer.keep = logical.scatter_(2, layout.positions[:, None, :].expand_as(keep), keep)
    new_norms = None if norms is None else kept_in_order(memo[norms_key], keep, layer)
    return Reselection(keep, new_norms)


def kept_in_order(per_entry: torch.Tensor, keep: torch.Tensor, layer: CompressedLayer) -> torch.Tensor:
    """(S, L) the (B, H_kv, T) ``per_entry`` values of each segment's kept entries, in position order
    (``L`` the layer's longest segment; zero beyond a segment's length)."""
    s, t = keep.shape[0] * keep.shape[1], keep.shape[-1]
    width = layer.storage.prefix_width()
    keep_s = keep.reshape(s, t)
    order = torch.argsort((~keep_s).to(torch.int8), dim=-1, stable=True)[:, :width]
    picked = per_entry.reshape(s, t).gather(1, order)
    return picked * keep_s.gather(1, order)
