"""The CPU implementation of ``torch.ops.criticalkv.ragged_decode``: the C kernel
(``ragged_decode.c``) called with one checked argument struct (:class:`~.args.DecodeArgs`).

It reads every sequence's blocks through the op's block table at the sequence's own length (no
padding: the ragged heads of AdaKV or DefensiveKV cost what their entries cost), dequantizing
8/4-bit codes on the fly in one pass, float32 entries as they are, with the work items (runs of a
sequence's blocks, split-K) shared among torch's threads. Inputs it does not take (not float32,
statistics not float16, a value group that does not divide the head dimension) and machines
without a compiler go to the op's torch reference, with one log line saying why (never a failure).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from criticalkv.ops.cpu import build
from criticalkv.ops.cpu.args import DecodeArgs
from criticalkv.ops.cpu.build import decode_kernel
from criticalkv.ops.ragged_decode import ragged_decode
from criticalkv.ops.reference import OUTSIDE_POOL, check_entry_starts, check_layout, ragged_decode_reference

logger = logging.getLogger(__name__)
_said: set[str] = set()


def forget() -> None:
    """Forget what this process remembers of the CPU kernel (:func:`build.forget`) and the reasons
    already logged for using the torch reference, as a fresh process would."""
    build.forget()
    _said.clear()


def unsupported(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    tail_keys: torch.Tensor | None,
    bits: int,
    stats: tuple[torch.Tensor | None, ...],
    value_group: int,
) -> str | None:
    """Why the C kernel does not take these inputs, or ``None`` if it does."""
    if query.dtype != torch.float32 or (tail_keys is not None and tail_keys.dtype != torch.float32):
        return f"queries and tail in {query.dtype}, not float32"
    if bits == 16:
        return None if key_pool.dtype == torch.float32 else f"16-bit entries in {key_pool.dtype}, not float32"
    if any(stat is None or stat.dtype != torch.float16 for stat in stats):
        return "quantization statistics that are not float16"
    d = int(query.shape[-1])
    group = value_group or d
    if d % group:
        return f"a value group of {group} channels that does not divide the head dimension {d}"
    return None


def ragged_decode_cpu(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    scaling: float,
    tail_keys: torch.Tensor | None = None,
    tail_values: torch.Tensor | None = None,
    tail_mask: torch.Tensor | None = None,
    bits: int = 16,
    key_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    value_zero: torch.Tensor | None = None,
    value_group: int = 0,
    entry_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op on CPU: the C kernel where it builds and takes the inputs, else the torch reference."""
    stats = (key_scale, key_zero, value_scale, value_zero)
    layout = (query, key_pool, value_pool, block_table, lengths, block_size, scaling)
    arguments = (*layout, tail_keys, tail_values, tail_mask, bits, *stats, value_group, entry_starts)
    why = unsupported(query, key_pool, tail_keys, bits, stats, value_group)
    library = decode_kernel() if why is None else None
    if library is None:
        if why is not None and why not in _said:
            _said.add(why)
            logger.info("ragged_decode on CPU uses the torch reference for %s", why)
        return ragged_decode_reference(*arguments)
    return c_ragged_decode(library, *arguments)


def c_ragged_decode(
    library: ctypes.CDLL,
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    scaling: float,
    tail_keys: torch.Tensor | None = None,
    tail_values: torch.Tensor | None = None,
    tail_mask: torch.Tensor | None = None,
    bits: int = 16,
    key_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    value_zero: torch.Tensor | None = None,
    value_group: int = 0,
    entry_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op's arguments checked, then run by the C kernel ``library`` (inputs it takes: see
    :func:`unsupported`). Raises ``ValueError`` on a layout that does not fit, before any read."""
    check_layout(query, key_pool, value_pool, block_table, lengths, block_size, tail_keys, tail_values, tail_mask, bits)
    check_entry_starts(entry_starts)
    why = unsupported(query, key_pool, tail_keys, bits, (key_scale, key_zero, value_scale, value_zero), value_group)
    if why is not None:
        raise ValueError(f"the C kernel does not take {why}")
    layout = (block_table, lengths, entry_starts)
    tail = (tail_keys, tail_values, tail_mask)
    stats = (key_scale, key_zero, value_scale, value_zero)
    return _call(library, query, (key_pool, value_pool), layout, block_size, scaling, tail, bits, stats, value_group)


def pool_blocks(
    pools: tuple[torch.Tensor, torch.Tensor],
    block_size: int,
    entry_starts: torch.Tensor | None,
    stats: tuple[torch.Tensor | None, ...],
    vgroups: int,
) -> int:
    """How many blocks the pool holds, after checking that values and statistics cover it (the C
    kernel reads them by the key pool's rows and blocks)."""
    rows, d = int(pools[0].shape[0]), vgroups
    blocks = int(entry_starts.shape[0]) if entry_starts is not None else -(-rows // block_size)
    if int(pools[1].shape[0]) != rows:
        raise ValueError(f"value_pool has {int(pools[1].shape[0])} rows, key_pool {rows}")
    key_scale, key_zero, value_scale, value_zero = stats
    for name, stat, least in (("key_scale", key_scale, blocks), ("key_zero", key_zero, blocks)):
        if stat is not None and (stat.dim() != 2 or int(stat.shape[0]) < least):
            raise ValueError(f"{name} must have a row for each of the {least} pool blocks, not {tuple(stat.shape)}")
    for name, stat in (("value_scale", value_scale), ("value_zero", value_zero)):
        if stat is not None and tuple(stat.shape) != (rows, d):
            raise ValueError(f"{name} must be ({rows}, {d}), not {tuple(stat.shape)}")
    return blocks


def _call(
    library: ctypes.CDLL,
    query: torch.Tensor,
    pools: tuple[torch.Tensor, torch.Tensor],
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    block_size: int,
    scaling: float,
    tail: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    bits: int,
    stats: tuple[torch.Tensor | None, ...],
    value_group: int,
) -> torch.Tensor:
    """Fill the argument struct (every tensor it points at kept alive and contiguous) and run the kernel."""
    s, q, d = (int(x) for x in query.shape)
    table, lengths, starts = layout
    out = torch.empty(s, q, d, dtype=torch.float32)
    args = DecodeArgs(size=ctypes.sizeof(DecodeArgs), S=s, Q=q, d=d, bits=32 if bits == 16 else bits)
    args.block_size, args.M, args.threads, args.scaling = (
        block_size,
        int(table.shape[1]),
        torch.get_num_threads(),
        scaling,
    )
    args.vgroups = 1 if bits == 16 else d // (value_group or d)
    args.P, args.NB = int(pools[0].shape[0]), pool_blocks(pools, block_size, starts, stats, int(args.vgroups))
    if bits != 16 and stats[0] is not None and int(stats[0].shape[1]) != d:
        raise ValueError(f"key statistics must have {d} channels, not {int(stats[0].shape[1])}")
    keep = [out]  # every tensor whose pointer the struct holds stays alive through the call
    args.out = out.data_ptr()
    _set(args, ("query", "p_k", "p_v", "table", "lengths"), (query, *pools, table, lengths), keep)
    _set(args, ("entry_starts", "p_ks", "p_kz", "p_vs", "p_vz"), (starts, *stats), keep)
    tail_keys, tail_values, tail_mask = tail
    if tail_keys is not None and tail_values is not None and int(tail_keys.shape[1]):
        args.t = int(tail_keys.shape[1])
        tail_keys, tail_values = _rows_in_place(tail_keys, tail_values)
        args.tail_stride, args.tail_k, args.tail_v = tail_keys.stride(0), tail_keys.data_ptr(), tail_values.data_ptr()
        keep += [tail_keys, tail_values]
        _set(args, ("mask",), (tail_mask,), keep)
    status = library.ckv_ragged_decode(ctypes.byref(args))
    if status == -2:
        raise RuntimeError("the C decode kernel was built for another argument layout: delete it to rebuild it")
    if status == -3:
        raise ValueError(OUTSIDE_POOL)
    if status != 0:
        raise MemoryError("the C decode kernel could not allocate its workspace")
    return out


def _rows_in_place(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail as the kernel reads it: each sequence's (T, d) entries contiguous, the sequences one
    stride apart (a slice of a larger buffer as it is), both tensors with the same stride."""
    t, d = int(keys.shape[1]), int(keys.shape[2])
    rows_dense = keys.stride(2) == 1 and (t == 1 or keys.stride(1) == d)
    if rows_dense and values.stride() == keys.stride():
        return keys, values
    return keys.contiguous(), values.contiguous()


def _set(args: DecodeArgs, names: tuple[str, ...], tensors: tuple[torch.Tensor | None, ...], keep: list) -> None:
    """Point ``args``'s fields ``names`` at contiguous copies (or the tensors themselves) of ``tensors``."""
    for name, tensor in zip(names, tensors, strict=True):
        if tensor is None:
            continue
        contiguous = tensor.contiguous()
        keep.append(contiguous)
        setattr(args, name, contiguous.data_ptr())


def register() -> None:
    """Register :func:`ragged_decode_cpu` as the op's CPU implementation."""
    ragged_decode.register_kernel("cpu")(ragged_decode_cpu)
