"""One layer of the physically compressed cache: a transformers cache layer over a storage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from criticalkv.cache.routing import announce
from criticalkv.cache.storage import MIN_GROWTH, Geometry, Storage
from criticalkv.cache.storage_table import new_storage

__all__ = ["MIN_GROWTH", "AttendHook", "CompressedLayer", "PrefillHook"]

PrefillHook = Callable[["CompressedLayer", torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any], None]
#: (layer, queries, appended values, 4D mask, attention module), after each attention over the layer
AttendHook = Callable[["CompressedLayer", torch.Tensor, torch.Tensor, torch.Tensor | None, Any], None]


class CompressedLayer(CacheLayerMixin):
    """A layer whose every (batch row, KV head) holds only the entries it kept.

    Its entries live in a :class:`~criticalkv.cache.storage.Storage` (the one
    :mod:`~criticalkv.cache.storage_table` gives for the cache's spec); the layer keeps what the
    model and the selection see: the logical length (prompt
    tokens before eviction plus appended tokens), the kept positions, the batch geometry, and the
    mask of the appended tokens.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, layer_idx: int, on_prefill: PrefillHook | None = None, storage: Storage | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.on_prefill = on_prefill
        self.on_attend: AttendHook | None = None  # decode-time compression (cache/decode/)
        self.storage = new_storage(None) if storage is None else storage
        self.keep: torch.Tensor | None = None
        self.prefix_len = 0
        self.batch_size = 0
        self.num_kv_heads = 0
        self.head_dim = 0
        self.tail_may_have_padding = False
        self.holds_prompt = False

    # --- transformers' CacheLayerMixin interface -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.holds_prompt:
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
        self.storage = self.storage.empty()
        self.keep = None
        self.prefix_len = 0
        self.tail_may_have_padding = False
        self.holds_prompt = False
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        index = torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats)
        self.batch_select_indices(index)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Rebuild the layer for the batch rows ``indices`` (beam search, repeated samples)."""
        if not self.holds_prompt:
            return
        indices = indices.to(self.device).long()
        h = self.num_kv_heads
        segments = (indices[:, None] * h + torch.arange(h, device=self.device)).reshape(-1)
        self.storage.select_segments(segments, int(indices.shape[0]))
        self.batch_size = int(indices.shape[0])
        self.keep = self.keep[indices] if self.keep is not None else None

    # --- compression and storage -----------------------------------------------------------------
    @property
    def tail_len(self) -> int:
        """Tokens appended since the prompt (or the last re-selection), the same for every head."""
        return self.storage.tail_len if self.holds_prompt else 0

    def set_prefix(
        self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, logical_len: int | None = None
    ) -> None:
        """Store the kept entries of the prompt's (B, H_kv, T, d) keys/values.

        With ``logical_len`` (a decode-time re-selection, :mod:`~criticalkv.cache.decode`) the
        entries are those the layer already held, laid out on ``T`` columns, and the layer's logical
        length is ``logical_len``.
        """
        b, h, t, d = keys.shape
        self.storage.set_prefix(keys, values, keep, reselected=logical_len is not None)
        self.batch_size, self.num_kv_heads, self.head_dim = b, h, d
        self.device, self.dtype = keys.device, keys.dtype
        self.keep = keep
        self.prefix_len = t if logical_len is None else logical_len
        self.tail_may_have_padding = False
        self.holds_prompt = True
        self.is_initialized = True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append (B, H_kv, q, d) entries to every segment's tail."""
        if key_states.shape[0] != self.batch_size:
            raise ValueError(f"the compressed cache holds {self.batch_size} rows but {key_states.shape[0]} were passed")
        s, q, d = self.batch_size * self.num_kv_heads, key_states.shape[2], self.head_dim
        self.storage.append(key_states.reshape(s, q, d), value_states.reshape(s, q, d))

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of (B, H_q, q, d) queries (already appended) -> (B, q, H_q, d)."""
        b, h_q, q, d = query.shape
        h = self.num_kv_heads
        g = h_q // h
        t = self.tail_len
        tail_mask = self._tail_mask(attention_mask, b, g, q, t) if t > 0 else None
        out = self.storage.attend(query.reshape(b * h, g * q, d), tail_mask, scaling)
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

    # --- copies and files ------------------------------------------------------------------------
    def fork(self, on_prefill: PrefillHook | None = None) -> CompressedLayer:
        """A layer sharing this one's compressed prompt (read-only) with an empty tail of its own."""
        if not self.holds_prompt:
            raise ValueError("only a cache that already holds a compressed prompt can be forked")
        clone = CompressedLayer(self.layer_idx, on_prefill, self.storage.share())
        clone.restore_shape(self.geometry(), self.keep, self.prefix_len, self.tail_may_have_padding)
        return clone

    def geometry(self) -> Geometry:
        """The batch rows, KV heads, head size, dtype and device of what the layer holds."""
        return Geometry(self.batch_size, self.num_kv_heads, self.head_dim, self.dtype, self.device)

    def restore_shape(self, geometry: Geometry, keep: torch.Tensor | None, prefix_len: int, padded: bool) -> None:
        """Set what the layer knows of its prompt (its storage already holds the entries): a fork or a file."""
        self.batch_size, self.num_kv_heads, self.head_dim = (
            geometry.batch_size,
            geometry.num_kv_heads,
            geometry.head_dim,
        )
        self.device, self.dtype = geometry.device, geometry.dtype
        self.keep, self.prefix_len, self.tail_may_have_padding = keep, prefix_len, padded
        self.holds_prompt = self.is_initialized = True

    # --- accounting ------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held by this layer's keys and values (tail capacity included)."""
        return self.storage.nbytes() if self.holds_prompt else 0

    def prefix_lengths(self) -> torch.Tensor:
        """(B, H_kv) prompt entries each head holds (its prefix)."""
        if not self.holds_prompt:
            raise ValueError("the cache holds no compressed prompt yet")
        return self.storage.lengths.view(self.batch_size, self.num_kv_heads)

    def segment_bytes(self) -> torch.Tensor:
        """(B, H_kv) bytes each head's prefix holds."""
        return self.storage.segment_bytes().view(self.batch_size, self.num_kv_heads)

    def kept_per_head(self) -> torch.Tensor:
        """(B, H_kv) entries each head holds (prefix plus tail)."""
        return self.prefix_lengths() + self.tail_len

    def tail_capacity(self) -> int:
        """Tail entries per head that fit before the storage grows."""
        return self.storage.capacity() if self.holds_prompt else 0

    def limit_tail(self, room: int | None) -> None:
        """Size the tail for at most ``room`` entries per head before it is emptied (``None``: unknown)."""
        self.storage.tail_room = room
