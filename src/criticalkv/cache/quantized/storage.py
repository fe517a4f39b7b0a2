"""Quantized storage of a compressed layer's kept entries (``kv_bits`` 8 or 4).

The compressed prompt is a :class:`~criticalkv.cache.quantized.prefix.QuantizedPrefix`. Appended
tokens go to a full-precision residual; once it holds ``residual + G`` entries per segment, its
oldest whole blocks of ``G`` are quantized into the quantized tail, so the most recent
``residual`` to ``residual + G - 1`` tokens stay exact. Decode attention is one call of
``torch.ops.criticalkv.ragged_decode`` per layer and step: the prefix's pooled codes read through
its block table (:mod:`criticalkv.cache.quantized.paged`), the quantized tail blocks dequantized
and the residual as the op's dense tail. Which implementation runs is the op's choice per device
(the C kernel on CPU, Triton on CUDA, its torch reference elsewhere; :mod:`criticalkv.ops`).
"""

from __future__ import annotations

from typing import Any

import torch

from criticalkv.cache.quantized.code_blocks import QuantizedBlocks, empty_blocks, quantize_blocks, write_blocks
from criticalkv.cache.quantized.codec import value_group
from criticalkv.cache.quantized.paged import PagedQuantized, paged_quantized
from criticalkv.cache.quantized.persist import (
    BLOCK_FIELDS,
    as_blocks,
    prefix_tensors,
    restore_prefix,
)
from criticalkv.cache.quantized.precision import DEFAULT_RESIDUAL, KVQuantization
from criticalkv.cache.quantized.prefix import QuantizedPrefix, build_quantized_prefix
from criticalkv.cache.storage import Geometry, Storage
from criticalkv.ops import ragged_decode


class QuantizedStorage(Storage):
    """Kept prompt entries and older appended tokens in ``spec.bits`` bits, the newest appended
    ones exact (see the module docstring; :class:`~criticalkv.cache.storage.Storage`)."""

    spec: KVQuantization

    def __init__(self, spec: KVQuantization) -> None:
        super().__init__(spec)
        self.residual = spec.residual_for(None)
        self.prefix: QuantizedPrefix | None = None
        self.tail_room: int | None = None
        self._empty_tail()

    def _empty_tail(self) -> None:
        self.tail_blocks: QuantizedBlocks | None = None
        self.tail_used = 0
        self.residual_keys: torch.Tensor | None = None
        self.residual_values: torch.Tensor | None = None
        self.residual_len = 0
        self.tail_len = 0
        self._paged: tuple[QuantizedPrefix, PagedQuantized] | None = None  # the op's block table, for this prefix

    def _prefix(self) -> QuantizedPrefix:
        if self.prefix is None:
            raise RuntimeError("this storage holds no prefix yet")
        return self.prefix

    def _geometry(self) -> Geometry:
        if self.geometry is None:
            raise RuntimeError("this storage holds no prefix yet")
        return self.geometry

    @classmethod
    def check_budget(cls, spec: KVQuantization, budget_tokens: int) -> None:
        spec.check_budget(budget_tokens)  # an explicit residual longer than the budget

    # --- the prefix ------------------------------------------------------------------------------
    def set_prefix(self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, *, reselected: bool) -> None:
        """Quantize and store the kept entries. A re-selection (``reselected``) quantizes the
        layer's dequantized entries again in blocks of the new selection; the residual length set
        at the prefill stays."""
        b, h, _, d = keys.shape
        self.spec.check_head_dim(d)
        if not reselected:
            per_head = int(keep.reshape(b, -1).sum(-1).min()) // max(1, h)  # the smallest row's budget per head
            self.residual = self.spec.residual_for(per_head)
        self.geometry = Geometry.of(keys)
        self.prefix = build_quantized_prefix(keys, values, keep, self.spec.bits, self.spec.group_size)
        self._empty_tail()

    @property
    def lengths(self) -> torch.Tensor:
        return self._prefix().lengths

    def prefix_width(self) -> int:
        lengths = self._prefix().lengths  # no tiers of entries: its lengths say it
        return int(lengths.max()) if lengths.numel() else 0

    def dense_prefix(self) -> tuple[torch.Tensor, torch.Tensor]:
        geometry = self._geometry()
        return self._prefix().dense(geometry.head_dim, geometry.dtype)

    # --- the tail --------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append (S, q, d) entries; quantize the residual's oldest whole blocks beyond ``residual``."""
        prefix = self._prefix()
        q = int(keys.shape[1])
        if not prefix.identity:
            keys, values = keys[prefix.perm], values[prefix.perm]
        need = self.residual_len + q
        capacity = 0 if self.residual_keys is None else int(self.residual_keys.shape[1])
        if need > capacity:  # it never holds more than residual + G - 1 + q, nor more than the tail's room
            grown = need + self.spec.group_size
            self._grow_residual(grown if self.tail_room is None else max(need, min(grown, self.tail_room)))
        assert self.residual_keys is not None and self.residual_values is not None
        self.residual_keys[:, self.residual_len : need] = keys
        self.residual_values[:, self.residual_len : need] = values
        self.residual_len = need
        self.tail_len += q
        g = self.spec.group_size
        whole = (self.residual_len - self.residual) // g if self.residual_len >= self.residual + g else 0
        if whole:
            self._quantize_oldest(whole)

    def _grow_residual(self, capacity: int) -> None:
        geometry = self._geometry()
        grown_k = torch.empty(
            geometry.segments, capacity, geometry.head_dim, dtype=geometry.dtype, device=geometry.device
        )
        grown_v = torch.empty_like(grown_k)
        if self.residual_keys is not None and self.residual_values is not None and self.residual_len:
            grown_k[:, : self.residual_len] = self.residual_keys[:, : self.residual_len]
            grown_v[:, : self.residual_len] = self.residual_values[:, : self.residual_len]
        self.residual_keys, self.residual_values = grown_k, grown_v

    def _quantize_oldest(self, count: int) -> None:
        """Move the residual's oldest ``count`` blocks into the quantized tail."""
        assert self.residual_keys is not None and self.residual_values is not None
        g, geometry = self.spec.group_size, self._geometry()
        n = count * g
        block = quantize_blocks(
            self.residual_keys[:, :n], self.residual_values[:, :n], self.spec.bits, g
        )  # all real: padding in the tail is masked at attention time, like the full-precision tail
        need = self.tail_used + count
        capacity = 0 if self.tail_blocks is None else self.tail_blocks.num_blocks
        if need > capacity:
            grown = empty_blocks(
                geometry.segments, self._blocks_for(need), geometry.head_dim, self.spec.bits, g, geometry.device
            )
            if self.tail_blocks is not None and self.tail_used:
                write_blocks(grown, 0, _first_blocks(self.tail_blocks, self.tail_used))
            self.tail_blocks = grown
        assert self.tail_blocks is not None
        write_blocks(self.tail_blocks, self.tail_used, block)
        self.tail_used = need
        rest = self.residual_len - n
        self.residual_keys[:, :rest] = self.residual_keys[:, n : self.residual_len].clone()
        self.residual_values[:, :rest] = self.residual_values[:, n : self.residual_len].clone()
        self.residual_len = rest

    def _blocks_for(self, need: int) -> int:
        """Tail blocks to allocate when ``need`` must fit: geometric, capped by the tail's room."""
        grown = _block_capacity(need)
        return grown if self.tail_room is None else max(need, min(grown, -(-self.tail_room // self.spec.group_size)))

    def dense_tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantized blocks dequantized, then the exact residual."""
        prefix, geometry = self._prefix(), self._geometry()
        keys, values = self._sorted_tail(geometry.dtype)
        if keys is None or values is None:
            empty = torch.zeros(geometry.segments, 0, geometry.head_dim, dtype=geometry.dtype, device=geometry.device)
            return empty, empty.clone()
        if not prefix.identity:
            keys, values = keys[prefix.inv_perm], values[prefix.inv_perm]
        return keys, values

    # --- attention -------------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, tail_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Through ``torch.ops.criticalkv.ragged_decode``: the pooled codes and the block table; the
        quantized tail blocks dequantized and the residual as its dense tail."""
        prefix, geometry, g = self._prefix(), self._geometry(), self.spec.group_size
        pool = prefix.decode_pool()
        if self._paged is None or self._paged[0] is not prefix:
            self._paged = (prefix, paged_quantized(prefix, pool, g))
        paged = self._paged[1]
        if not prefix.identity:
            query = query.index_select(0, prefix.perm)
            tail_mask = None if tail_mask is None else tail_mask.index_select(0, prefix.perm)
        width = geometry.head_dim * self.spec.bits // 8
        empty = query.new_zeros(0, width, dtype=torch.uint8)
        stats = [getattr(pool, name) if pool is not None else None for name in ("key_scale", "key_zero")]
        stats += [getattr(pool, name) if pool is not None else None for name in ("value_scale", "value_zero")]
        tail_k, tail_v = self._sorted_tail(geometry.dtype, views=True)
        out = ragged_decode(
            query,
            empty if pool is None else pool.key_codes,
            empty if pool is None else pool.value_codes,
            paged.table,
            paged.lengths,
            g,
            scaling,
            tail_k,
            tail_v,
            tail_mask if tail_k is not None else None,
            self.spec.bits,
            *stats,
            value_group(g, geometry.head_dim),
            paged.entry_starts,
        )
        return out if prefix.identity else out.index_select(0, prefix.inv_perm)

    def _sorted_tail(self, dtype: torch.dtype, views: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The quantized tail blocks dequantized, then the exact residual, in sorted segment order
        (new tensors; with ``views``, the residual's own slices when it is all there is)."""
        parts_k, parts_v = [], []
        if self.tail_blocks is not None and self.tail_used:
            k, v = self.tail_blocks.dequantize(0, self.tail_used, dtype)
            parts_k.append(k)
            parts_v.append(v)
        if self.residual_keys is not None and self.residual_values is not None and self.residual_len:
            parts_k.append(self.residual_keys[:, : self.residual_len])
            parts_v.append(self.residual_values[:, : self.residual_len])
        if not parts_k:
            return None, None
        if views and len(parts_k) == 1 and self.tail_used == 0:  # the residual alone, read in place by the op
            return parts_k[0], parts_v[0]
        return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)

    # --- copies ----------------------------------------------------------------------------------
    def share(self) -> QuantizedStorage:
        clone = QuantizedStorage(self.spec)
        clone.geometry, clone.prefix = self.geometry, self._prefix()
        clone.residual, clone.tail_room = self.residual, self.tail_room
        return clone

    def select_segments(self, segments: torch.Tensor, batch_size: int) -> None:
        identity = torch.arange(self._geometry().segments, device=segments.device)
        if segments.shape == identity.shape and torch.equal(segments, identity):
            return
        raise ValueError(
            "a quantized cache (kv_bits 8 or 4) cannot reorder or repeat its rows (beam search, "
            "num_return_sequences > 1): use kv_bits=16 or one row per prompt"
        )

    # --- files -----------------------------------------------------------------------------------
    def file_tensors(self) -> dict[str, torch.Tensor]:
        """The codes, scales and zero points (``q.<part>.<field>``) and the residual's used entries;
        ``keys``/``values`` are empty (the file format's 16-bit fields)."""
        prefix, geometry = self._prefix(), self._geometry()
        empty = torch.empty(0, dtype=geometry.dtype, device=geometry.device)
        out = {"keys": empty, "values": empty, "perm": prefix.perm, "lengths": prefix.lengths}
        out.update(prefix_tensors(prefix))
        if self.tail_blocks is not None and self.tail_used:
            for name, tensor in zip(BLOCK_FIELDS, self.tail_blocks.parts(), strict=True):
                out[f"q.tail.{name}"] = tensor[:, : self.tail_used].contiguous()
        if self.residual_keys is not None and self.residual_values is not None and self.residual_len:
            out["q.residual_keys"] = self.residual_keys[:, : self.residual_len]
            out["q.residual_values"] = self.residual_values[:, : self.residual_len]
        return out

    def file_header(self) -> dict[str, Any]:
        return {
            "identity": self._prefix().identity,
            "tail_len": self.tail_len,
            "tail_capacity": self.capacity(),
            "residual": self.residual,
            "tail_used": self.tail_used,
            "tail_block_capacity": 0 if self.tail_blocks is None else self.tail_blocks.num_blocks,
            "residual_len": self.residual_len,
            "residual_capacity": 0 if self.residual_keys is None else int(self.residual_keys.shape[1]),
        }

    def restore(self, geometry: Geometry, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        where, spec = geometry.device, self.spec
        self.geometry = geometry
        quantized = {k: v.to(where) for k, v in tensors.items() if k.startswith("q.")}
        perm, lengths = tensors["perm"].to(where), tensors["lengths"].to(where)
        self.prefix = restore_prefix(
            quantized, perm, lengths, header["identity"], geometry.head_dim, spec.bits, spec.group_size
        )
        self._empty_tail()
        self.residual = header["residual"]
        if header["tail_block_capacity"]:
            self.tail_blocks = empty_blocks(
                geometry.segments, header["tail_block_capacity"], geometry.head_dim, spec.bits, spec.group_size, where
            )
            if header["tail_used"]:
                saved = [quantized[f"q.tail.{name}"] for name in BLOCK_FIELDS]
                write_blocks(self.tail_blocks, 0, as_blocks(saved, spec.bits, spec.group_size))
            self.tail_used = header["tail_used"]
        if header["residual_capacity"]:
            self._grow_residual(header["residual_capacity"])
            assert self.residual_keys is not None and self.residual_values is not None
            r = header["residual_len"]
            if r:
                self.residual_keys[:, :r] = quantized["q.residual_keys"]
                self.residual_values[:, :r] = quantized["q.residual_values"]
            self.residual_len = r
        self.tail_len = header["tail_len"]

    # --- accounting ------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Packed codes + scales + zero points of the prefix and quantized tail, plus the
        full-precision residual (capacity included)."""
        total = 0 if self.prefix is None else self.prefix.nbytes()
        if self.tail_blocks is not None:
            total += self.tail_blocks.nbytes()
        for tensor in (self.residual_keys, self.residual_values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total

    def segment_bytes(self) -> torch.Tensor:
        return self._prefix().segment_bytes()

    def capacity(self) -> int:
        blocks = 0 if self.tail_blocks is None else self.tail_blocks.num_blocks * self.spec.group_size
        return blocks + (0 if self.residual_keys is None else int(self.residual_keys.shape[1]))

    @classmethod
    def tail_bytes(cls, spec: Any, geometry: Geometry, first: int, tokens: int) -> int:
        """The residual grows to ``need + G`` when full and keeps at most ``residual + G`` entries
        after an append of one, so its capacity stays within ``max(first + G, min(tokens, residual + G) + G)``;
        the quantized blocks (at most ``tokens // G``) grow by :func:`_block_capacity`."""
        g = spec.group_size
        residual = DEFAULT_RESIDUAL if spec.residual is None else spec.residual  # the default is capped below it
        capacity = max(first + g, min(tokens, residual + g) + g)
        blocks = tokens // g
        block_capacity = _block_capacity(blocks) if blocks else 0
        block = empty_blocks(1, 1, geometry.head_dim, spec.bits, g, torch.device("cpu")).nbytes()
        per_segment = capacity * 2 * geometry.head_dim * geometry.element_size + block_capacity * block
        return geometry.segments * per_segment


def _block_capacity(need: int) -> int:
    """Blocks the quantized tail grows to when ``need`` must fit."""
    return need + max(2, need // 8)


def _first_blocks(blocks: QuantizedBlocks, count: int) -> QuantizedBlocks:
    return QuantizedBlocks(
        blocks.key_codes[:, :count],
        blocks.key_scale[:, :count],
        blocks.key_zero[:, :count],
        blocks.value_codes[:, :count],
        blocks.value_scale[:, :count],
        blocks.value_zero[:, :count],
        None,
        blocks.bits,
        blocks.group,
    )
