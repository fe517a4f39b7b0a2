"""16-bit ragged storage: the prompt's kept entries as tiers, appended ones in a dense tail, both
moved into length buckets at the first append of an owned prefix (:mod:`.length_buckets`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from criticalkv.cache.layouts.length_buckets import LengthBuckets
from criticalkv.cache.layouts.paged import paged_prefix
from criticalkv.cache.layouts.ragged_attention import ragged_attention
from criticalkv.cache.layouts.tiers import RaggedPrefix, build_prefix, restore_prefix
from criticalkv.cache.storage import Geometry, Storage, tail_capacity
from criticalkv.ops import decode_through_op, ragged_decode


class RaggedStorage(Storage):
    """Entries in the model's dtype, exact bytes (:class:`~criticalkv.cache.storage.Storage`).

    The compressed prompt is a :class:`RaggedPrefix` (no padding); appended tokens go to a dense
    ``(S, capacity, d)`` tail that grows by :func:`~criticalkv.cache.storage.tail_capacity`. A prefix
    this storage owns moves, with its tail, into :class:`LengthBuckets` at the first append: with one
    bucket (uniform budgets) the tiers and the tail are views into it; with several they are empty
    until read back (:meth:`_settle`), so bytes are never held twice.
    """

    def __init__(self, spec: None = None) -> None:
        super().__init__(spec)
        self.prefix: RaggedPrefix | None = None
        self.tail_keys: torch.Tensor | None = None
        self.tail_values: torch.Tensor | None = None
        self.tail_len = 0
        self.fused: LengthBuckets | None = None
        self.owns_prefix = False
        self.tail_room: int | None = None

    # --- the prefix ------------------------------------------------------------------------------
    def set_prefix(self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, *, reselected: bool) -> None:
        self.geometry = Geometry.of(keys)
        self.prefix = build_prefix(keys, values, keep)
        self._empty_tail()
        self.owns_prefix = True

    def _empty_tail(self) -> None:
        self.tail_keys = self.tail_values = None
        self.tail_len = 0
        self.fused = None

    def _prefix(self) -> RaggedPrefix:
        if self.prefix is None:
            raise RuntimeError("this storage holds no prefix yet")
        return self.prefix

    @property
    def lengths(self) -> torch.Tensor:
        return self._prefix().lengths

    def prefix_width(self) -> int:
        self.settle()
        return sum(int(tier.keys.shape[1]) for tier in self._prefix().tiers)  # read off the shapes: no sync

    def dense_prefix(self) -> tuple[torch.Tensor, torch.Tensor]:
        geometry, width = self._geometry(), self.prefix_width()
        prefix = self._prefix()
        keys = torch.zeros(geometry.segments, width, geometry.head_dim, dtype=geometry.dtype, device=geometry.device)
        values = torch.zeros_like(keys)
        offset = 0
        for tier in prefix.tiers:
            n, w = int(tier.keys.shape[0]), int(tier.keys.shape[1])
            keys[:n, offset : offset + w], values[:n, offset : offset + w] = tier.keys, tier.values
            offset += w
        if not prefix.identity:
            keys, values = keys[prefix.inv_perm], values[prefix.inv_perm]
        return keys, values

    def _geometry(self) -> Geometry:
        if self.geometry is None:
            raise RuntimeError("this storage holds no prefix yet")
        return self.geometry

    # --- the tail --------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        prefix = self._prefix()
        need = self.tail_len + int(keys.shape[1])
        if self.owns_prefix and not decode_through_op(keys.device):  # the op reads the tiers and the plain tail
            self._fuse(need, keys)
            assert self.fused is not None
            self.fused.write(keys, values, self.tail_len)
            self.tail_len = need
            return
        if not prefix.identity:
            keys, values = keys[prefix.perm], values[prefix.perm]
        if need > self.capacity():
            self._grow_tail(tail_capacity(need, self.tail_room))
        assert self.tail_keys is not None and self.tail_values is not None
        self.tail_keys[:, self.tail_len : need] = keys
        self.tail_values[:, self.tail_len : need] = values
        self.tail_len = need

    def _fuse(self, need: int, like: torch.Tensor) -> None:
        """Build (first append) or grow the length buckets so that ``need`` tail entries fit."""
        prefix = self._prefix()
        capacity = tail_capacity(need, self.tail_room)
        if self.fused is None:
            tail = self.tail_keys, self.tail_values
            self.fused = LengthBuckets.build(prefix, *tail, self.tail_len, max(capacity, self.tail_len), like)
        elif need > self.fused.capacity:
            self.fused = self.fused.grown(prefix, self.tail_len, capacity)
        else:
            return
        # a new prefix object: forks made earlier keep theirs (the old tensors stay valid)
        single = self.fused.single
        self.prefix = dataclasses.replace(prefix, tiers=self.fused.tiers() if single else [], paged=None)
        self.tail_keys, self.tail_values = self.fused.tail() if single else (None, None)

    def settle(self) -> None:
        """Put the entries back in ``prefix.tiers`` and the plain tail (for readers); appends rebucket."""
        if self.fused is None or self.fused.single or self.prefix is None:
            return
        self.prefix = dataclasses.replace(self.prefix, tiers=self.fused.tiers(), paged=None)
        self.tail_keys, self.tail_values = self.fused.tail()
        self.fused = None

    def _grow_tail(self, capacity: int) -> None:
        """Reallocate the plain tail with room for ``capacity`` entries per segment (contents kept)."""
        geometry = self._geometry()
        tail_k = torch.empty(
            geometry.segments, capacity, geometry.head_dim, dtype=geometry.dtype, device=geometry.device
        )
        tail_v = torch.empty_like(tail_k)
        if self.tail_keys is not None and self.tail_values is not None and self.tail_len:
            tail_k[:, : self.tail_len] = self.tail_keys[:, : self.tail_len]
            tail_v[:, : self.tail_len] = self.tail_values[:, : self.tail_len]
        self.tail_keys, self.tail_values = tail_k, tail_v

    def dense_tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.settle()
        prefix, geometry, t = self._prefix(), self._geometry(), self.tail_len
        if not t or self.tail_keys is None or self.tail_values is None:
            empty = torch.zeros(geometry.segments, 0, geometry.head_dim, dtype=geometry.dtype, device=geometry.device)
            return empty, empty.clone()
        tail_k, tail_v = self.tail_keys[:, :t], self.tail_values[:, :t]
        if not prefix.identity:
            tail_k, tail_v = tail_k[prefix.inv_perm], tail_v[prefix.inv_perm]
        return tail_k, tail_v

    # --- attention -------------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, tail_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        if decode_through_op(query.device):
            return self._attend_op(query, tail_mask, scaling)
        prefix, t = self._prefix(), self.tail_len
        if self.fused is not None:  # the buckets read segment order themselves
            return self.fused.attend(query, tail_mask, t, scaling)
        assert self.tail_keys is not None or t == 0
        if not prefix.identity:  # index_select: far cheaper than [perm]
            query = query.index_select(0, prefix.perm)
            tail_mask = None if tail_mask is None else tail_mask.index_select(0, prefix.perm)
        out = ragged_attention(
            query,
            prefix.tiers,
            None if self.tail_keys is None else self.tail_keys[:, :t],
            None if self.tail_values is None else self.tail_values[:, :t],
            tail_mask,
            scaling,
        )
        return out if prefix.identity else out.index_select(0, prefix.inv_perm)

    def _attend_op(self, query: torch.Tensor, tail_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Through ``torch.ops.criticalkv.ragged_decode``: the tiers as a paged pool, the plain tail."""
        self.settle()
        prefix, geometry, t = self._prefix(), self._geometry(), self.tail_len
        paged = paged_prefix(prefix, geometry.segments, geometry.head_dim, query)
        if not prefix.identity:
            query = query.index_select(0, prefix.perm)
            tail_mask = None if tail_mask is None else tail_mask.index_select(0, prefix.perm)
        tail = t and self.tail_keys is not None and self.tail_values is not None
        out = ragged_decode(
            query,
            paged.keys,
            paged.values,
            paged.table,
            paged.lengths,
            1,
            scaling,
            self.tail_keys[:, :t] if tail else None,  # type: ignore[index]
            self.tail_values[:, :t] if tail else None,  # type: ignore[index]
            tail_mask if tail else None,
        )
        return out if prefix.identity else out.index_select(0, prefix.inv_perm)

    # --- copies ----------------------------------------------------------------------------------
    def share(self) -> RaggedStorage:
        self.settle()  # the copy shares the tiers (length buckets hold them otherwise)
        clone = RaggedStorage()
        clone.geometry, clone.prefix, clone.tail_room = self.geometry, self._prefix(), self.tail_room
        return clone  # owns_prefix False: shared read-only, appends go to the clone's own tail

    def select_segments(self, segments: torch.Tensor, batch_size: int) -> None:
        self.settle()
        prefix, geometry = self._prefix(), self._geometry()
        h, d = geometry.num_kv_heads, geometry.head_dim
        pieces = [prefix.segment(int(s)) for s in segments]
        longest = max(int(k.shape[0]) for k, _ in pieces)
        keys = torch.zeros(batch_size * h, longest, d, dtype=geometry.dtype, device=geometry.device)
        values = torch.zeros_like(keys)
        keep = torch.zeros(batch_size * h, longest, dtype=torch.bool, device=geometry.device)
        for i, (k, v) in enumerate(pieces):
            keys[i, : k.shape[0]], values[i, : v.shape[0]], keep[i, : k.shape[0]] = k, v, True
        tail = None
        if self.tail_keys is not None and self.tail_values is not None:
            order = prefix.inv_perm[segments]
            tail = (self.tail_keys[order, : self.tail_len], self.tail_values[order, : self.tail_len])
        shape = (batch_size, h, longest, d)
        self.set_prefix(keys.view(shape), values.view(shape), keep.view(batch_size, h, -1), reselected=True)
        if tail is not None:
            self.append(*tail)

    # --- files -----------------------------------------------------------------------------------
    def file_tensors(self) -> dict[str, torch.Tensor]:
        self.settle()  # tiers and tail hold the entries (length buckets hold them only while decoding)
        prefix, geometry = self._prefix(), self._geometry()
        empty = torch.empty(0, dtype=geometry.dtype, device=geometry.device)
        tensors = {
            "keys": torch.cat([t.keys.reshape(-1) for t in prefix.tiers]) if prefix.tiers else empty,
            "values": torch.cat([t.values.reshape(-1) for t in prefix.tiers]) if prefix.tiers else empty,
            "perm": prefix.perm,
            "lengths": prefix.lengths,
        }
        if self.tail_len and self.tail_keys is not None and self.tail_values is not None:
            tensors["tail_keys"] = self.tail_keys[:, : self.tail_len]
            tensors["tail_values"] = self.tail_values[:, : self.tail_len]
        return tensors

    def file_header(self) -> dict[str, Any]:
        return {"identity": self._prefix().identity, "tail_len": self.tail_len, "tail_capacity": self.capacity()}

    def restore(self, geometry: Geometry, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        where = geometry.device
        self.geometry = geometry
        perm, lengths = tensors["perm"].to(where), tensors["lengths"].to(where)
        keys, values = tensors["keys"].to(where), tensors["values"].to(where)
        self.prefix = restore_prefix(keys, values, perm, lengths, geometry.head_dim, header["identity"])
        self._empty_tail()
        self.owns_prefix = True
        if header["tail_len"]:
            self._grow_tail(header["tail_capacity"])
            assert self.tail_keys is not None and self.tail_values is not None
            self.tail_keys[:, : header["tail_len"]] = tensors["tail_keys"].to(where)
            self.tail_values[:, : header["tail_len"]] = tensors["tail_values"].to(where)
            self.tail_len = header["tail_len"]

    # --- accounting ------------------------------------------------------------------------------
    def nbytes(self) -> int:
        if self.fused is not None:
            return self.fused.nbytes()
        total = 0 if self.prefix is None else self.prefix.nbytes()
        for tensor in (self.tail_keys, self.tail_values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total

    def segment_bytes(self) -> torch.Tensor:
        geometry = self._geometry()
        return self.lengths * (2 * geometry.head_dim * geometry.element_size)

    def capacity(self) -> int:
        if self.fused is not None:
            return self.fused.capacity
        return 0 if self.tail_keys is None else int(self.tail_keys.shape[1])

    @classmethod
    def tail_bytes(cls, spec: Any, geometry: Geometry, first: int, tokens: int) -> int:
        """The tail grows once to ``tail_capacity(first)`` and again whenever an append overflows it."""
        capacity = tail_capacity(first)
        while capacity < tokens:
            capacity = tail_capacity(capacity + 1)
        return geometry.segments * capacity * 2 * geometry.head_dim * geometry.element_size
