"""What a :class:`~criticalkv.cache.layer.CompressedLayer` keeps its entries in: one interface,
one implementation per storage subpackage.

A layer's entries are *segments*, one per (batch row, KV head), numbered ``b * H_kv + h`` (the
original order); each holds the prompt entries it kept (its prefix, in position order) and the
tokens appended since (its tail, the same count for every segment). A storage stores them and
answers everything a layer, a fork, a re-selection, a file or a memory budget asks of them; the
layer only reshapes, masks and counts. The 16-bit ragged layouts
(:class:`~criticalkv.cache.layouts.RaggedStorage`) and quantized storage
(:class:`~criticalkv.cache.quantized.QuantizedStorage`) implement it; a new storage (fp8, a paged
GPU layout) is one new subpackage with one more implementation, and one line of the storage
table (:mod:`~criticalkv.cache.storage_table`) maps the type of its spec to it. Nothing outside
a storage's subpackage and that table names or asks which kind a layer holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

#: spare tail capacity when a tail grows without a known end: max(MIN_GROWTH, 12.5% of the new length)
MIN_GROWTH = 64


def tail_capacity(need: int, room: int | None = None) -> int:
    """The capacity a tail grows to when ``need`` entries per segment must fit: geometric
    (``need + max(MIN_GROWTH, need // 8)``, an append amortised O(1)) or, with ``room`` (the most the
    tail holds before it is emptied, e.g. by a decode-time re-selection), never more than that
    room, and never less than ``need``."""
    grown = need + max(MIN_GROWTH, need // 8)
    return grown if room is None else max(need, min(grown, room))


@dataclass(frozen=True)
class Geometry:
    """The shape of what one layer stores: segments (``batch * kv_heads``), head size, dtype, device."""

    batch_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def segments(self) -> int:
        return self.batch_size * self.num_kv_heads

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, keys: torch.Tensor) -> Geometry:
        """The geometry of (B, H_kv, T, d) keys."""
        b, h, _, d = keys.shape
        return cls(int(b), int(h), int(d), keys.dtype, keys.device)


class Storage(ABC):
    """The entries of one layer (see the module docstring). Tensors in and out are per segment,
    in the original segment order: ``(S, n, d)``. A storage is built empty from its spec alone,
    ``cls(spec)`` (:func:`~criticalkv.cache.storage_table.new_storage`)."""

    #: the storage part of the cache's spec (``None``: the model's dtype)
    spec: Any = None
    geometry: Geometry | None = None
    #: entries appended per segment since the prefix was set
    tail_len: int = 0
    #: the most tail entries per segment held before the tail is emptied (``None``: unknown)
    tail_room: int | None = None

    def __init__(self, spec: Any = None) -> None:
        self.spec = spec

    def empty(self) -> Storage:
        """A new, empty storage of the same kind and spec."""
        return type(self)(self.spec)

    # --- the prefix ------------------------------------------------------------------------------
    @abstractmethod
    def set_prefix(self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, *, reselected: bool) -> None:
        """Store the ``keep`` (B, H_kv, T) entries of (B, H_kv, T, d) ``keys``/``values``; the
        tail becomes empty. ``reselected``: a decode-time re-selection of entries already held."""

    @property
    @abstractmethod
    def lengths(self) -> torch.Tensor:
        """(S,) prefix entries per segment."""

    @abstractmethod
    def prefix_width(self) -> int:
        """The longest segment's prefix entries (read without a device synchronisation where possible)."""

    @abstractmethod
    def dense_prefix(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, prefix_width, d) keys and values of every prefix, zero beyond a segment's length
        (quantized storage: dequantized); a transient copy for re-selection."""

    # --- the tail --------------------------------------------------------------------------------
    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append (S, q, d) entries to every segment's tail."""

    @abstractmethod
    def dense_tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, tail_len, d) keys and values of every tail as held (a transient copy where quantized)."""

    # --- attention -------------------------------------------------------------------------------
    @abstractmethod
    def attend(self, query: torch.Tensor, tail_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """(S, Q, d) queries over each segment's prefix and tail -> (S, Q, d); ``tail_mask``
        (S, Q, tail_len) bool (True: attend) or ``None`` (every tail entry)."""

    # --- copies ----------------------------------------------------------------------------------
    @abstractmethod
    def share(self) -> Storage:
        """A storage that reads this prefix (shared, read-only) with an empty tail of its own (a fork)."""

    @abstractmethod
    def select_segments(self, segments: torch.Tensor, batch_size: int) -> None:
        """Keep only ``segments`` (an index into the original order, ``batch_size`` rows of
        ``H_kv``), prefix and tail (beam search, repeated samples)."""

    # --- files -----------------------------------------------------------------------------------
    @abstractmethod
    def file_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors (no spare capacity), named as the cache file names them."""

    @abstractmethod
    def file_header(self) -> dict[str, Any]:
        """What :meth:`restore` needs beyond the tensors and the geometry (JSON values)."""

    @abstractmethod
    def restore(self, geometry: Geometry, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Rebuild the prefix and tail from :meth:`file_tensors` and :meth:`file_header` (on
        ``geometry.device``)."""

    # --- accounting ------------------------------------------------------------------------------
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held (prefix and tail, spare tail capacity included)."""

    @abstractmethod
    def segment_bytes(self) -> torch.Tensor:
        """(S,) bytes each segment's prefix holds."""

    @abstractmethod
    def capacity(self) -> int:
        """Tail entries per segment that fit without growing."""

    @classmethod
    def check_budget(cls, spec: Any, budget_tokens: int) -> None:
        """A clear error, before any work, if ``spec`` cannot store a cache whose smallest per-head
        budget is ``budget_tokens`` entries (every budget fits unless a storage says otherwise)."""
        return None

    @classmethod
    @abstractmethod
    def tail_bytes(cls, spec: Any, geometry: Geometry, first: int, tokens: int) -> int:
        """The most bytes a tail of ``tokens`` appended entries per segment holds (capacity
        included) when its first append is ``first`` of them and the rest come one at a time."""
