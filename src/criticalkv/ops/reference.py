"""The reference of :func:`~criticalkv.ops.ragged_decode`: dequantize every sequence's entries,
then attend in float32 with one softmax over the entries and the tail. Plain torch, any device:
the oracle every faster implementation is tested against, and the fallback where none is."""

from __future__ import annotations

import torch


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., D) from ``bits``-bit storage: 8 bits as stored, 4 bits two a byte (even
    channel in the low nibble, the packing of :mod:`criticalkv.cache.quantized.codec`)."""
    if bits == 8:
        return packed
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def check_layout(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    tail_keys: torch.Tensor | None,
    tail_values: torch.Tensor | None,
    tail_mask: torch.Tensor | None,
    bits: int,
) -> None:
    """A ``ValueError`` naming the argument whose shape or dtype does not fit the layout."""
    if query.dim() != 3:
        raise ValueError(f"query must be (S, Q, D), not {tuple(query.shape)}")
    s, q, d = query.shape
    if bits not in (16, 8, 4):
        raise ValueError(f"bits must be 16, 8 or 4, not {bits}")
    width = d if bits == 16 else d * bits // 8
    for name, pool in (("key_pool", key_pool), ("value_pool", value_pool)):
        if pool.dim() != 2 or int(pool.shape[1]) != width:
            raise ValueError(
                f"{name} must be (P, {width}) for head dimension {d} at {bits} bits, not {tuple(pool.shape)}"
            )
    if block_table.dim() != 2 or int(block_table.shape[0]) != s or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be ({s}, M) int32, not {tuple(block_table.shape)} {block_table.dtype}")
    if tuple(lengths.shape) != (s,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be ({s},) int32, not {tuple(lengths.shape)} {lengths.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, not {block_size}")
    if (tail_keys is None) != (tail_values is None):
        raise ValueError("tail_keys and tail_values come together")
    if tail_keys is not None and tail_values is not None:
        t = int(tail_keys.shape[1]) if tail_keys.dim() == 3 else -1
        if tuple(tail_keys.shape) != (s, t, d) or tuple(tail_values.shape) != (s, t, d):
            raise ValueError(f"the tail must be ({s}, T, {d}), not {tuple(tail_keys.shape)}")
        if tail_mask is not None and (tuple(tail_mask.shape) != (s, q, t) or tail_mask.dtype != torch.bool):
            raise ValueError(f"tail_mask must be ({s}, {q}, {t}) bool, not {tuple(tail_mask.shape)} {tail_mask.dtype}")


def check_entry_starts(entry_starts: torch.Tensor | None) -> None:
    """A ``ValueError`` unless ``entry_starts`` is absent or (NB,) int32."""
    if entry_starts is not None and (entry_starts.dim() != 1 or entry_starts.dtype != torch.int32):
        raise ValueError(f"entry_starts must be (NB,) int32, not {tuple(entry_starts.shape)} {entry_starts.dtype}")


#: what every implementation says of a block table or lengths that reach outside the pool
OUTSIDE_POOL = "the block table or lengths reach outside the pool"


def reaches_outside_pool(
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    pool_rows: int,
    entry_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """A 0-d bool tensor on the table's device: whether some sequence's length or blocks reach
    outside the pool (a length below 0 or beyond its row of the table, a block the length uses that
    is -1 or no pool block, or whose rows pass the pool's ``pool_rows``). The check every
    implementation makes before reading (the C kernel's own, in C, is the same rule)."""
    m = int(block_table.shape[1])
    lengths = lengths.long()
    offsets = torch.arange(m, device=block_table.device)[None, :] * block_size
    used = offsets < lengths[:, None]  # (S, M): the blocks each length reaches
    blocks = block_table.long()
    n_blocks = int(entry_starts.shape[0]) if entry_starts is not None else -(-pool_rows // block_size)
    bad = ((lengths < 0) | (lengths > m * block_size)).any()
    bad = bad | (used & ((blocks < 0) | (blocks >= n_blocks))).any()
    if n_blocks == 0:
        return bad | used.any()
    safe = blocks.clamp(0, n_blocks - 1)
    starts = safe * block_size if entry_starts is None else entry_starts.long()[safe]
    rows = (lengths[:, None] - offsets).clamp(0, block_size)
    return bad | (used & ((starts < 0) | (starts + rows > pool_rows))).any()


def check_in_pool(
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    pool_rows: int,
    entry_starts: torch.Tensor | None = None,
) -> None:
    """A ``ValueError`` (:data:`OUTSIDE_POOL`) if :func:`reaches_outside_pool`. On a CUDA table the
    check is asynchronous (``torch._assert_async``: no host sync on the decode path; a table outside
    the pool stops the process with a device-side assert rather than reading past the pool)."""
    outside = reaches_outside_pool(block_table, lengths, block_size, pool_rows, entry_starts)
    if outside.device.type == "cuda":
        torch._assert_async(~outside, OUTSIDE_POOL)
    elif bool(outside):
        raise ValueError(OUTSIDE_POOL)


def gather_rows(
    block_table: torch.Tensor, lengths: torch.Tensor, block_size: int, entry_starts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(S, M * block_size) pool rows of every sequence's entries in order (0 where there is none),
    the block of each, and the (S, M * block_size) mask of those that exist."""
    s, m = block_table.shape
    offsets = torch.arange(block_size, device=block_table.device)
    blocks = block_table.long().clamp(min=0)
    starts = blocks * block_size if entry_starts is None else entry_starts.long()[blocks]
    rows = (starts[:, :, None] + offsets).reshape(s, m * block_size)
    valid = torch.arange(m * block_size, device=block_table.device)[None, :] < lengths.long()[:, None]
    block_of = blocks[:, :, None].expand(s, m, block_size).reshape(s, m * block_size)
    return rows * valid, block_of * valid, valid


def dequantized(
    pool: torch.Tensor,
    rows: torch.Tensor,
    bits: int,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    stat_rows: torch.Tensor,
    group: int,
) -> torch.Tensor:
    """(S, L, D) float32 entries at ``rows``: 16-bit entries as they are, codes as ``c * s + z``
    with the statistics at ``stat_rows`` (S, L), each covering ``group`` consecutive channels."""
    if bits == 16:
        return pool[rows].float()
    if scale is None or zero is None:
        raise ValueError(f"{bits}-bit codes need their scales and zero points")
    codes = unpack_codes(pool[rows], bits).float()
    s = scale[stat_rows].float().repeat_interleave(group, dim=-1)
    z = zero[stat_rows].float().repeat_interleave(group, dim=-1)
    return codes * s + z


#: at most this many (padded) entries are dequantized at once, so a layer is never held whole in
#: float32: sequences are attended in chunks of ``CHUNK_ENTRIES // (M * block_size)`` (at least one)
CHUNK_ENTRIES = 1 << 16


def ragged_decode_reference(
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
    """Dequantize, then attend (see :mod:`criticalkv.ops.ragged_decode` for the layout), a chunk of
    sequences at a time (:data:`CHUNK_ENTRIES`)."""
    check_layout(query, key_pool, value_pool, block_table, lengths, block_size, tail_keys, tail_values, tail_mask, bits)
    check_entry_starts(entry_starts)
    check_in_pool(block_table, lengths, block_size, int(key_pool.shape[0]), entry_starts)
    pools = (key_pool, value_pool)
    stats = (key_scale, key_zero, value_scale, value_zero)
    s = int(query.shape[0])
    step = max(1, CHUNK_ENTRIES // max(1, int(block_table.shape[1]) * block_size))
    parts = []
    for i in range(0, s, step):
        rows = slice(i, min(s, i + step))
        tail = tuple(None if t is None else t[rows] for t in (tail_keys, tail_values, tail_mask))
        layout = (block_table[rows], lengths[rows], block_size, entry_starts)
        parts.append(_attend_chunk(query[rows], pools, stats, layout, scaling, tail, bits, value_group))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _attend_chunk(
    query: torch.Tensor,
    pools: tuple[torch.Tensor, torch.Tensor],
    stats: tuple[torch.Tensor | None, ...],
    layout: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None],
    scaling: float,
    tail: tuple[torch.Tensor | None, ...],
    bits: int,
    value_group: int,
) -> torch.Tensor:
    """The reference over some sequences: gather and dequantize their entries, one softmax each."""
    key_pool, value_pool = pools
    key_scale, key_zero, value_scale, value_zero = stats
    block_table, lengths, block_size, entry_starts = layout
    tail_keys, tail_values, tail_mask = tail
    rows, block_of, valid = gather_rows(block_table, lengths, block_size, entry_starts)
    keys = dequantized(key_pool, rows, bits, key_scale, key_zero, block_of, 1)
    values = dequantized(value_pool, rows, bits, value_scale, value_zero, rows, value_group or int(query.shape[-1]))
    q = query.float() * scaling
    scores = torch.matmul(q, keys.transpose(1, 2)).masked_fill(~valid[:, None, :], float("-inf"))
    if tail_keys is not None and tail_values is not None:
        tail_scores = torch.matmul(q, tail_keys.float().transpose(1, 2))
        if tail_mask is not None:
            tail_scores = tail_scores.masked_fill(~tail_mask, float("-inf"))
        scores = torch.cat([scores, tail_scores], dim=-1)
        values = torch.cat([values, tail_values.float()], dim=1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # nothing to attend: zeros
    return torch.matmul(probs, values).to(query.dtype)
