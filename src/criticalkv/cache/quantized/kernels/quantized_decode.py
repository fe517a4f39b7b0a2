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
from criticalkv.cache.quantized.kernels.args import DecodeArgs
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
    args = DecodeArgs(size=ctypes.sizeof(DecodeArgs), S=s, Q=q, d=d, bits=bits, group=group)
    args.vgroups, args.threads, args.scaling = d // min(group, d), torch.get_num_threads(), scaling
    keep = [query, perm, out]  # every tensor whose pointer the struct holds stays alive through the call
    args.query, args.perm, args.out = _ptr(query), _ptr(perm), _ptr(out)
    if pool is not None:
        stored = (pool.key_codes, pool.value_codes, pool.value_scale, pool.value_zero, pool.key_scale, pool.key_zero)
        _set(args, ("p_kc", "p_vc", "p_vs", "p_vz", "p_ks", "p_kz"), stored, keep)
    _set(
        args,
        ("seg_offsets", "blk_entry", "blk_row", "blk_len"),
        (blocks.offsets, blocks.entry, blocks.row, blocks.length),
        keep,
    )
    if tail_used and tail is not None:
        args.tail_used, args.tail_cap = tail_used, tail.num_blocks
        _set(args, ("t_kc", "t_ks", "t_kz", "t_vc", "t_vs", "t_vz"), tail.parts(), keep)
    if residual_len and residual_keys is not None and residual_values is not None:
        args.r, args.res_stride = residual_len, int(residual_keys.shape[1]) * d
        _set(args, ("res_k", "res_v"), (residual_keys, residual_values), keep)
    if tail_mask is not None:
        mask = tail_mask.to(torch.bool).contiguous()  # one byte each, 0 or 1
        args.mask, args.mask_t = _ptr(mask), int(mask.shape[-1])
        keep.append(mask)
    status = library.ckv_quantized_decode(ctypes.byref(args))
    if status == -2:
        raise RuntimeError("the C decode kernel was built for another argument layout: delete it to rebuild it")
    if status != 0:
        raise MemoryError("the C decode kernel could not allocate its workspace")
    return out


def _set(args: DecodeArgs, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], keep: list) -> None:
    """Point ``args``'s fields ``names`` at contiguous copies (or the tensors themselves) of ``tensors``."""
    for name, tensor in zip(names, tensors, strict=True):
        contiguous = tensor.contiguous()
        keep.append(contiguous)
        setattr(args, name, contiguous.data_ptr())
