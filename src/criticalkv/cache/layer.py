"""One layer of the physically compressed cache."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from criticalkv.cache.layouts import LengthBuckets, RaggedPrefix, build_prefix, ragged_attention
from criticalkv.cache.routing import announce

#: spare tail capacity when the tail grows: max(MIN_GROWTH, 12.5% of the new length)
MIN_GROWTH = 64

PrefillHook = Callable[["CompressedLayer", torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any], None]
#: (layer, queries, appended values, 4D mask, attention module), after each attention over the layer
AttendHook = Callable[["CompressedLayer", torch.Tensor, torch.Tensor, torch.Tensor | None, Any], None]


class CompressedLayer(CacheLayerMixin):
    """A layer whose every (batch row, KV head) holds only the entries it kept.

    The compressed prompt is a :class:`RaggedPrefix` (exact bytes, no padding); tokens
    appended afterwards (the question in question-agnostic mode, generated tokens) go to a
    dense tail of shape (S, capacity, d) that grows geometrically, so an append is amortised
    O(1) per head and spare capacity stays below max(12.5%, 64 entries).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, layer_idx: int, on_prefill: PrefillHook | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.on_prefill = on_prefill
        self.on_attend: AttendHook | None = None  # decode-time compression (cache/decode/budget.py)
        self.prefix: RaggedPrefix | None = None
        self.keep: torch.Tensor | None = None
        self.prefix_len = 0
        self.batch_size = 0
        self.num_kv_heads = 0
        self.head_dim = 0
        self.tail_keys: torch.Tensor | None = None
        self.tail_values: torch.Tensor | None = None
        self.tail_len = 0
        self.tail_may_have_padding = False
        #: an owned prefix moves, with the tail, into length buckets (cache/layouts/buckets.py) at the first append;
        #: one bucket (uniform): ``prefix.tiers`` and ``tail_keys``/``tail_values`` are views into it;
        #: several: those are empty/None until :meth:`settle` (bytes are the buckets', never twice)
        self.fused: LengthBuckets | None = None
        self.owns_prefix = False

    # --- transformers' CacheLayerMixin interface -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefix is None:
            if self.on_prefill is None:
                raise RuntimeError("this compressed cache layer has no prompt and no way to compress one")
            self.lazy_initialization(key_states, value_states)
        else:
            self.append(key_states, value_states)
        announce(self, self.layer_idx)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        # transformers >= 5.3 passes the query length; 5.2 passes the cache positions
        length = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.get_seq_length() + length, 0

    def get_seq_length(self) -> int:
        """Logical length: prompt tokens seen (before eviction) plus appended tokens."""
        return self.prefix_len + self.tail_len

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the name transformers 5.2 uses
        return -1

    def reset(self) -> None:
        self.prefix = None
        self.keep = None
        self.prefix_len = self.tail_len = 0
        self.tail_keys = self.tail_values = None
        self.tail_may_have_padding = False
        self.fused = None
        self.owns_prefix = False
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        index = torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats)
        self.batch_select_indices(index)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Rebuild the layer for the batch rows ``indices`` (beam search, repeated samples)."""
        if self.prefix is None:
            return
        self.settle()
        indices = indices.to(self.device).long()
        h, d = self.num_kv_heads, self.head_dim
        old_segments = (indices[:, None] * h + torch.arange(h, device=self.device)).reshape(-1)
        pieces = [self.prefix.segment(int(s)) for s in old_segments]
        longest = max(int(k.shape[0]) for k, _ in pieces)
        new_b = int(indices.shape[0])
        keys = torch.zeros(new_b * h, longest, d, dtype=self.dtype, device=self.device)
        values = torch.zeros_like(keys)
        keep = torch.zeros(new_b * h, longest, dtype=torch.bool, device=self.device)
        for i, (k, v) in enumerate(pieces):
            keys[i, : k.shape[0]], values[i, : v.shape[0]], keep[i, : k.shape[0]] = k, v, True
        tail = None
        if self.tail_keys is not None and self.tail_values is not None:
            order = self.prefix.inv_perm[old_segments]
            tail = (self.tail_keys[order, : self.tail_len], self.tail_values[order, : self.tail_len])
        old_keep = self.keep[indices] if self.keep is not None else None
        logical_len = self.prefix_len
        padded = self.tail_may_have_padding
        self.set_prefix(
            keys.view(new_b, h, longest, d),
            values.view(new_b, h, longest, d),
            keep.view(new_b, h, -1),
            logical_len=logical_len,
        )
        self.keep = old_keep
        self.tail_keys = self.tail_values = None
        self.tail_len = 0
        if tail is not None:
            assert self.prefix is not None
            unsorted_k = tail[0].view(new_b, h, -1, d)
            unsorted_v = tail[1].view(new_b, h, -1, d)
            self.append(unsorted_k, unsorted_v)
        self.tail_may_have_padding = padded

    # --- compression and storage -----------------------------------------------------------------
    def set_prefix(
        self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, logical_len: int | None = None
    ) -> None:
        """Store the kept entries of the prompt's (B, H_kv, T, d) keys/values."""
        b, h, t, d = keys.shape
        self.batch_size, self.num_kv_heads, self.head_dim = b, h, d
        self.device, self.dtype = keys.device, keys.dtype
        self.prefix = build_prefix(keys, values, keep)
        self.keep = keep
        self.prefix_len = t if logical_len is None else logical_len
        self.tail_may_have_padding = False
        self.tail_keys = self.tail_values = None
        self.tail_len = 0
        self.fused = None
        self.owns_prefix = True
        self.is_initialized = True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append (B, H_kv, q, d) entries to every segment's tail."""
        assert self.prefix is not None
        s, q, d = self.batch_size * self.num_kv_heads, key_states.shape[2], self.head_dim
        if key_states.shape[0] != self.batch_size:
            raise ValueError(f"the compressed cache holds {self.batch_size} rows but {key_states.shape[0]} were passed")
        new_k = key_states.reshape(s, q, d)
        new_v = value_states.reshape(s, q, d)
        need = self.tail_len + q
        if self.owns_prefix:
            self._fuse(need, new_k)
            assert self.fused is not None
            self.fused.write(new_k, new_v, self.tail_len)
            self.tail_len = need
            return
        if not self.prefix.identity:
            new_k, new_v = new_k[self.prefix.perm], new_v[self.prefix.perm]
        capacity = 0 if self.tail_keys is None else int(self.tail_keys.shape[1])
        if need > capacity:
            self._grow_tail(need + max(MIN_GROWTH, need // 8))
        assert self.tail_keys is not None and self.tail_values is not None
        self.tail_keys[:, self.tail_len : need] = new_k
        self.tail_values[:, self.tail_len : need] = new_v
        self.tail_len = need

    def _fuse(self, need: int, like: torch.Tensor) -> None:
        """Build (first append) or grow the length buckets so that ``need`` tail entries fit."""
        assert self.prefix is not None
        capacity = need + max(MIN_GROWTH, need // 8)
        if self.fused is None:
            tail = self.tail_keys, self.tail_values
            self.fused = LengthBuckets.build(self.prefix, *tail, self.tail_len, capacity, like)
        elif need > self.fused.capacity:
            self.fused = self.fused.grown(self.prefix, self.tail_len, capacity)
        else:
            return
        # a new prefix object: forks made earlier keep theirs (the old tensors stay valid)
        single = self.fused.single
        self.prefix = dataclasses.replace(self.prefix, tiers=self.fused.tiers() if single else [])
        self.tail_keys, self.tail_values = self.fused.tail() if single else (None, None)

    def settle(self) -> None:
        """Put the entries back in ``prefix.tiers`` and the plain tail (for readers); appends rebucket."""
        if self.fused is None or self.fused.single or self.prefix is None:
            return
        self.prefix = dataclasses.replace(self.prefix, tiers=self.fused.tiers())
        self.tail_keys, self.tail_values = self.fused.tail()
        self.fused = None

    def _grow_tail(self, capacity: int) -> None:
        """Reallocate the plain tail with room for ``capacity`` entries per segment (contents kept)."""
        assert self.prefix is not None
        s, d = self.batch_size * self.num_kv_heads, self.head_dim
        tail_k = torch.empty(s, capacity, d, dtype=self.dtype, device=self.device)
        tail_v = torch.empty_like(tail_k)
        if self.tail_keys is not None and self.tail_values is not None and self.tail_len:
            tail_k[:, : self.tail_len] = self.tail_keys[:, : self.tail_len]
            tail_v[:, : self.tail_len] = self.tail_values[:, : self.tail_len]
        self.tail_keys, self.tail_values = tail_k, tail_v

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of (B, H_q, q, d) queries (already appended) -> (B, q, H_q, d)."""
        assert self.prefix is not None
        b, h_q, q, d = query.shape
        h = self.num_kv_heads
        g = h_q // h
        prefix, t = self.prefix, self.tail_len
        q_flat = query.reshape(b * h, g * q, d)
        tail_mask = self._tail_mask(attention_mask, b, g, q, t) if t > 0 else None
        if self.fused is not None:  # the buckets read segment order themselves
            out = self.fused.attend(q_flat, tail_mask, t, scaling)
        else:
            assert self.tail_keys is not None or t == 0
            if not prefix.identity:  # index_select: far cheaper than [perm]
                q_flat = q_flat.index_select(0, prefix.perm)
                tail_mask = None if tail_mask is None else tail_mask.index_select(0, prefix.perm)
            out = ragged_attention(
                q_flat,
                prefix.tiers,
                None if self.tail_keys is None else self.tail_keys[:, :t],
                None if self.tail_values is None else self.tail_values[:, :t],
                tail_mask,
                scaling,
            )
            if not prefix.identity:
                out = out.index_select(0, prefix.inv_perm)
        return out.view(b, h, g, q, d).reshape(b, h_q, q, d).transpose(1, 2)

    def _tail_mask(self, attention_mask: torch.Tensor | None, b: int, g: int, q: int, t: int) -> torch.Tensor | None:
        """(S, G*q, t) bool over the tail, from the model's 4D mask (causal and padding).

        No device synchronisation: a single-token step over a tail that never received a
        multi-token append (so no padding) needs no mask; otherwise the model's mask is used.
        """
        h = self.num_kv_heads
        if attention_mask is not None:
            if q == 1 and not self.tail_may_have_padding:
                return None
            if q > 1:
                self.tail_may_have_padding = True  # a padded question may have been appended
            cols = attention_mask[:, 0, -q:, self.prefix_len : self.prefix_len + t]
            if cols.dtype != torch.bool:
                cols = cols == 0
        elif q == 1:
            return None
        else:
            j = torch.arange(t, device=self.device)
            i = torch.arange(q, device=self.device)
            cols = (j[None, :] <= (t - q) + i[:, None])[None].expand(b, q, t)
        full = cols[:, None, None].expand(b, h, g, q, t)
        return full.reshape(b * h, g * q, t)

    # --- accounting ------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held by this layer's keys and values (tail capacity included)."""
        if self.fused is not None:
            return self.fused.nbytes()
        total = 0 if self.prefix is None else self.prefix.nbytes()
        for tensor in (self.tail_keys, self.tail_values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total

    def kept_per_head(self) -> torch.Tensor:
        """(B, H_kv) entries each head holds (prefix plus tail)."""
        assert self.prefix is not None
        return self.prefix.lengths.view(self.batch_size, self.num_kv_heads) + self.tail_len

    def tail_capacity(self) -> int:
        if self.fused is not None:
            return self.fused.capacity
        return 0 if self.tail_keys is None else int(self.tail_keys.shape[1])
