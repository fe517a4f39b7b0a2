"""The C decode kernel over quantized storage (``quantized_decode.c``), called through :mod:`ctypes`.

It computes what :func:`~criticalkv.cache.quantized.attention.quantized_attention` computes, but
segment by segment at each segment's own length (no tile padding: the ragged heads of AdaKV or
DefensiveKV cost what their entries cost), dequantizing codes on the fly in one pass. The prefix
is read through a :class:`BlockList`: every stored block of every sorted segment as (first pool
entry row, pool block row, entries), built once per prefix. Inputs must be CPU float32; the
caller (:class:`~criticalkv.cache.quantized.storage.QuantizedStorage`) keeps the torch kernel for
anything else.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from criticalkv.cache.quantized.blocks import QuantizedBlocks
from criticalkv.cache.quantized.pool import PrefixPool
from criticalkv.cache.quantized.prefix import QuantizedPrefix


@dataclass(frozen=True)
class BlockList:
    """Sorted segment ``s`` owns blocks ``[offsets[s], offsets[s + 1])``; block ``k`` is entries
    ``[entry[k], entry[k] + length[k])`` of the pool and key-statistics row ``row[k]``."""

    offsets: torch.Tensor  # (S + 1,) int64
    entry: torch.Tensor  # (K,) int64
    row: torch.Tensor  # (K,) int64
    length: torch.Tensor  # (K,) int64


def block_list(prefix: QuantizedPrefix, pool: PrefixPool | None, group: int) -> BlockList:
    """The :class:`BlockList` of ``prefix``, pooled as ``pool`` (``None``: no stored entries)."""
    s = int(prefix.lengths.shape[0])
    per_segment: list[list[tuple[int, int, int]]] = [[] for _ in range(s)]
    if pool is not None:
        for j, tier in enumerate(prefix.blocks):
            nb = tier.num_blocks
            for i in range(tier.num_segments):
                for b in range(nb):
                    entry = pool.entry_starts[j] + (i * nb + b) * group
                    per_segment[i].append((entry, pool.block_starts[j] + i * nb + b, group))
        part = prefix.partial
        if part is not None:
            start = pool.entry_starts[-1]
            for k, (row, length) in enumerate(zip(part.rows.tolist(), part.lengths.tolist(), strict=True)):
                per_segment[row].append((start, pool.block_starts[-1] + k, length))
                start += length
    offsets = [0]
    for blocks in per_segment:
        offsets.append(offsets[-1] + len(blocks))
    flat = [block for blocks in per_segment for block in blocks]
    columns = torch.tensor(flat, dtype=torch.long).reshape(-1, 3).T.contiguous()
    return BlockList(torch.tensor(offsets, dtype=torch.long), columns[0], columns[1], columns[2])


def supports(query: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether the C kernel takes these inputs: CPU float32 queries and residual."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and (residual is None or (residual.dtype == torch.float32 and residual.device.type == "cpu"))
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def c_quantized_attention(
    library: ctypes.CDLL,
    query: torch.Tensor,
    perm: torch.Tensor | None,
    pool: PrefixPool | None,
    blocks: BlockList,
    tail: QuantizedBlocks | None,
    tail_used: int,
    residual_keys: torch.Tensor | None,
    residual_values: torch.Tensor | None,
    residual_len: int,
    tail_mask: torch.Tensor | None,
    scaling: float,
    bits: int,
    group: int,
) -> torch.Tensor:
    """Attention of the queries (S, Q, d) over the pool, the tail and the residual.

    Parameters
    ----------
    library : :func:`~criticalkv.cache.quantized.kernels.build.decode_kernel`'s library.
    query : (S, Q, d) float32, in the **original** segment order (the result too).
    perm : (S,) int64, sorted segment ``s`` is row ``perm[s]`` of ``query``, ``tail_mask`` and the
        result; ``None``: the identity. Everything else is in sorted order.
    pool, blocks : the pooled prefix and its :func:`block_list` (``pool`` ``None``: no entries).
    tail, tail_used : the quantized tail (``S`` segments, any capacity) and its blocks in use.
    residual_keys, residual_values : (S, capacity, d) float32 full-precision residual buffers, of
        which the first ``residual_len`` entries of each segment are in use.
    tail_mask : (S, Q, tail_used * group + residual_len) bool (``True``: attend), original segment
        order, or ``None``.
    scaling : softmax scale.
    bits, group : the storage's bits and group size.

    Returns
    -------
    (S, Q, d) float32, the same as the torch kernel up to float32 rounding.
    """
    s, q, d = (int(x) for x in query.shape)
    query = query.contiguous()
    perm = None if perm is None else perm.to(torch.long).contiguous()
    out = torch.empty(s, q, d, dtype=torch.float32)
    vgroups = d // min(group, d)
    fields: list[torch.Tensor | None] = [None] * 6
    if pool is not None:
        stored = (pool.key_codes, pool.value_codes, pool.value_scale, pool.value_zero, pool.key_scale, pool.key_zero)
        fields = [t.contiguous() for t in stored]
    used = tail_used if tail is not None else 0
    tail_parts: list[torch.Tensor | None] = [None] * 6
    capacity = 0
    if used and tail is not None:
        tail_parts = [t.contiguous() for t in tail.parts()]
        capacity = tail.num_blocks
    r = residual_len if residual_keys is not None and residual_values is not None else 0
    res_k = res_v = None
    stride = 0
    if r and residual_keys is not None and residual_values is not None:
        res_k, res_v = residual_keys.contiguous(), residual_values.contiguous()
        stride = int(res_k.shape[1]) * d
    mask = None if tail_mask is None else tail_mask.to(torch.bool).contiguous()  # one byte each, 0 or 1
    status = library.ckv_quantized_decode(
        s, q, d, bits, group, vgroups,
        query.data_ptr(), _ptr(perm), scaling,
        *(_ptr(t) for t in fields),
        blocks.offsets.data_ptr(), blocks.entry.data_ptr(), blocks.row.data_ptr(), blocks.length.data_ptr(),
        used, capacity,
        *(_ptr(t) for t in tail_parts),
        r, stride, _ptr(res_k), _ptr(res_v),
        _ptr(mask), 0 if mask is None else int(mask.shape[-1]),
        out.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the C decode kernel could not allocate its workspace")
    return out
