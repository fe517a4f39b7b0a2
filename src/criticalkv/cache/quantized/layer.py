"""A compressed layer whose kept entries are stored quantized (``kv_bits`` 8 or 4).

The compressed prompt is a :class:`~criticalkv.cache.quantized.prefix.QuantizedPrefix`. Appended
tokens go to a full-precision residual; once it holds ``residual + G`` entries per segment, its
oldest whole blocks of ``G`` are quantized into the quantized tail, so the most recent
``residual`` to ``residual + G - 1`` tokens stay exact. Decode attention reads the quantized
blocks a tile of whole segments at a time (:mod:`criticalkv.cache.quantized.attention`), gathered
from the prefix's pooled tensors by a plan rebuilt when the tail gains a block
(:mod:`criticalkv.cache.quantized.plan`); on CPU float32, a compiled C kernel reads them segment by
segment instead (:mod:`criticalkv.cache.quantized.kernels.quantized_decode`).
"""

from __future__ import annotations

from typing import Any

import torch

from criticalkv.cache.layer import CompressedLayer, PrefillHook
from criticalkv.cache.quantized.attention import quantized_attention
from criticalkv.cache.quantized.blocks import QuantizedBlocks, empty_blocks, quantize_blocks, write_blocks
from criticalkv.cache.quantized.kernels.build import decode_kernel
from criticalkv.cache.quantized.kernels.quantized_decode import BlockList, block_list, c_quantized_attention, supports
from criticalkv.cache.quantized.plan import DecodePlan, plan
from criticalkv.cache.quantized.pool import PrefixPool
from criticalkv.cache.quantized.prefix import QuantizedPrefix, build_quantized_prefix
from criticalkv.cache.quantized.spec import KVQuantization


class QuantizedLayer(CompressedLayer):
    """A :class:`CompressedLayer` storing its kept prompt entries and older appended tokens in
    ``spec.bits`` bits (see the module docstring)."""

    def __init__(self, layer_idx: int, spec: KVQuantization, on_prefill: PrefillHook | None = None) -> None:
        super().__init__(layer_idx, on_prefill)
        self.spec = spec
        self.residual = spec.residual_for(None)
        self._clear_tail()

    def _clear_tail(self) -> None:
        self.tail_blocks: QuantizedBlocks | None = None
        self.tail_used = 0
        self.residual_keys: torch.Tensor | None = None
        self.residual_values: torch.Tensor | None = None
        self.residual_len = 0
        self.tail_len = 0
        self._plan: DecodePlan | None = None  # the decode tiles, for this prefix and tail_used
        self._blocks: tuple[QuantizedPrefix, BlockList] | None = None  # the C kernel's block list, for this prefix

    def reset(self) -> None:
        super().reset()
        self._clear_tail()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.prefix is None:
            return
        if torch.equal(indices.to(self.device).long(), torch.arange(self.batch_size, device=self.device)):
            return
        raise ValueError(
            "a quantized cache (kv_bits 8 or 4) cannot reorder or repeat its rows (beam search, "
            "num_return_sequences > 1): use kv_bits=16 or one row per prompt"
        )

    # --- storage ---------------------------------------------------------------------------------
    def set_prefix(
        self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, logical_len: int | None = None
    ) -> None:
        """Quantize and store the kept entries of the prompt's (B, H_kv, T, d) keys/values.

        With ``logical_len`` (a decode-time re-selection, :mod:`~criticalkv.cache.decode.reselect`) the
        entries are the layer's dequantized ones: they are quantized again in blocks of the new
        selection, and the residual length set at the prefill stays.
        """
        b, h, t, d = keys.shape
        self.spec.check_head_dim(d)
        if logical_len is None:
            per_head = int(keep.reshape(b, -1).sum(-1).min()) // max(1, h)  # the smallest row's budget per head
            self.spec.check_budget(per_head)
            self.residual = self.spec.residual_for(per_head)
        self.batch_size, self.num_kv_heads, self.head_dim = b, h, d
        self.device, self.dtype = keys.device, keys.dtype
        self.prefix = build_quantized_prefix(keys, values, keep, self.spec.bits, self.spec.group_size)
        self.keep = keep
        self.prefix_len = t if logical_len is None else logical_len
        self.tail_may_have_padding = False
        self.tail_keys = self.tail_values = None
        self.fused = None
        self.owns_prefix = True
        self.is_initialized = True
        self._clear_tail()

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append (B, H_kv, q, d) entries; quantize the residual's oldest whole blocks beyond ``residual``."""
        assert self.prefix is not None
        s, q, d = self.batch_size * self.num_kv_heads, key_states.shape[2], self.head_dim
        if key_states.shape[0] != self.batch_size:
            raise ValueError(f"the compressed cache holds {self.batch_size} rows but {key_states.shape[0]} were passed")
        new_k, new_v = key_states.reshape(s, q, d), value_states.reshape(s, q, d)
        if not self.prefix.identity:
            new_k, new_v = new_k[self.prefix.perm], new_v[self.prefix.perm]
        need = self.residual_len + q
        capacity = 0 if self.residual_keys is None else int(self.residual_keys.shape[1])
        if need > capacity:  # it never holds more than residual + G - 1 + q: little spare room needed
            self._grow_residual(need + self.spec.group_size)
        assert self.residual_keys is not None and self.residual_values is not None
        self.residual_keys[:, self.residual_len : need] = new_k
        self.residual_values[:, self.residual_len : need] = new_v
        self.residual_len = need
        self.tail_len += q
        g = self.spec.group_size
        whole = (self.residual_len - self.residual) // g if self.residual_len >= self.residual + g else 0
        if whole:
            self._quantize_oldest(whole)

    def _grow_residual(self, capacity: int) -> None:
        s, d = self.batch_size * self.num_kv_heads, self.head_dim
        grown_k = torch.empty(s, capacity, d, dtype=self.dtype, device=self.device)
        grown_v = torch.empty_like(grown_k)
        if self.residual_keys is not None and self.residual_values is not None and self.residual_len:
            grown_k[:, : self.residual_len] = self.residual_keys[:, : self.residual_len]
            grown_v[:, : self.residual_len] = self.residual_values[:, : self.residual_len]
        self.residual_keys, self.residual_values = grown_k, grown_v

    def _quantize_oldest(self, count: int) -> None:
        """Move the residual's oldest ``count`` blocks into the quantized tail."""
        assert self.residual_keys is not None and self.residual_values is not None
        g, s = self.spec.group_size, self.batch_size * self.num_kv_heads
        n = count * g
        block = quantize_blocks(
            self.residual_keys[:, :n], self.residual_values[:, :n], self.spec.bits, g
        )  # all real: padding in the tail is masked at attention time, like the full-precision tail
        need = self.tail_used + count
        capacity = 0 if self.tail_blocks is None else self.tail_blocks.num_blocks
        if need > capacity:
            grown = empty_blocks(s, need + max(2, need // 8), self.head_dim, self.spec.bits, g, self.device)
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

    # --- attention -------------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of (B, H_q, q, d) queries (already appended) -> (B, q, H_q, d).

        CPU float32 goes through the C kernel where it builds (``CRITICALKV_KERNEL``,
        :mod:`~criticalkv.cache.quantized.kernels.build`), everything else through the torch kernel.
        """
        prefix = self.prefix
        assert isinstance(prefix, QuantizedPrefix)
        b, h_q, q, d = query.shape
        h = self.num_kv_heads
        g = h_q // h
        flat = query.reshape(b * h, g * q, d)
        tail_mask = None
        if self.tail_len > 0:
            tail_mask = self._tail_mask(attention_mask, b, g, q, self.tail_len)
        pool = prefix.decode_pool()
        library = decode_kernel() if supports(query, self.residual_keys) else None
        if library is not None:
            if self._blocks is None or self._blocks[0] is not prefix:
                self._blocks = (prefix, block_list(prefix, pool, self.spec.group_size))
            out = c_quantized_attention(
                library,
                flat,
                None if prefix.identity else prefix.perm,
                pool,
                self._blocks[1],
                self.tail_blocks,
                self.tail_used,
                self.residual_keys,
                self.residual_values,
                self.residual_len,
                tail_mask,
                scaling,
                self.spec.bits,
                self.spec.group_size,
            )
        else:
            out = self._attend_torch(flat, tail_mask, pool, scaling)
        return out.view(b, h, g, q, d).reshape(b, h_q, q, d).transpose(1, 2)

    def _attend_torch(
        self, flat: torch.Tensor, tail_mask: torch.Tensor | None, pool: PrefixPool | None, scaling: float
    ) -> torch.Tensor:
        """The torch kernel: (S, Q, d) queries in original segment order -> (S, Q, d) outputs."""
        prefix = self.prefix
        assert isinstance(prefix, QuantizedPrefix)
        if not prefix.identity:
            flat = flat.index_select(0, prefix.perm)
            tail_mask = None if tail_mask is None else tail_mask[prefix.perm]
        r = self.residual_len
        room = 0 if self.residual_keys is None else int(self.residual_keys.shape[1])
        if self._plan is None or self._plan.tail_used != self.tail_used or self._plan.room < r:
            self._plan = plan(prefix, pool, self.spec.group_size, self.tail_used, room)
        out = quantized_attention(
            flat,
            pool,
            self._plan,
            self.tail_blocks,
            None if self.residual_keys is None else self.residual_keys[:, :r],
            None if self.residual_values is None else self.residual_values[:, :r],
            tail_mask,
            scaling,
            self.spec.bits,
            self.spec.group_size,
        )
        return out if prefix.identity else out.index_select(0, prefix.inv_perm)

    def dense_tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, t, d) keys and values of every segment's tail as held (quantized blocks dequantized,
        then the exact residual), original segment order: a transient copy for re-selection."""
        assert self.prefix is not None
        s, d = self.batch_size * self.num_kv_heads, self.head_dim
        parts_k, parts_v = [], []
        if self.tail_blocks is not None and self.tail_used:
            k, v = self.tail_blocks.dequantize(0, self.tail_used, self.dtype)
            parts_k.append(k)
            parts_v.append(v)
        if self.residual_keys is not None and self.residual_values is not None:
            parts_k.append(self.residual_keys[:, : self.residual_len])
            parts_v.append(self.residual_values[:, : self.residual_len])
        if not parts_k:
            empty = torch.zeros(s, 0, d, dtype=self.dtype, device=self.device)
            return empty, empty.clone()
        keys, values = torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)
        if not self.prefix.identity:
            keys, values = keys[self.prefix.inv_perm], values[self.prefix.inv_perm]
        return keys, values

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

    def tail_capacity(self) -> int:
        blocks = 0 if self.tail_blocks is None else self.tail_blocks.num_blocks * self.spec.group_size
        return blocks + (0 if self.residual_keys is None else int(self.residual_keys.shape[1]))


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


def make_layer(layer_idx: int, on_prefill: Any, spec: KVQuantization | None) -> CompressedLayer:
    """A :class:`QuantizedLayer` for ``spec``, a plain :class:`CompressedLayer` for ``None``."""
    if spec is None:
        return CompressedLayer(layer_idx, on_prefill=on_prefill)
    return QuantizedLayer(layer_idx, spec, on_prefill=on_prefill)
