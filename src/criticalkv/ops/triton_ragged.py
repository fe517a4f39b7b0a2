"""A Triton implementation of ``torch.ops.criticalkv.ragged_decode``, registered for CUDA.

The layout is the op's (:mod:`criticalkv.ops.ragged_decode`). Two kernels run per call:

* ``_split_kernel``, one program per (sequence ``s``, split ``k``): split ``k`` of the first
  ``n_splits`` reads the sequence's entries ``[k * E, (k + 1) * E)`` cut at ``lengths[s]`` (each
  sequence is read only to its own length), a tile of ``BLOCK_N`` entries at a time, each entry's
  pool row found through the block table (and ``entry_starts``), dequantizing 8/4-bit codes in
  registers; the last split, when there is a tail, reads the tail under its mask. All ``Q`` query
  rows of the sequence are in the program (a GQA group shares its KV head's reads). Channels are
  handled as two halves, the even and the odd ones, so 4-bit bytes split into their low (even)
  and high (odd) nibbles without a shuffle, and 16/8-bit entries take the same path. Each program
  keeps an online softmax in float32 and writes its running maximum, sum and weighted values.
* ``_merge_kernel``, one program per sequence: merges the splits with the log-sum-exp rescaling
  and writes (S, Q, D) in the query's dtype; a sequence with nothing attended gives zeros.

Importing this module without triton installed is a no-op (one debug line): nothing registers.
With triton, :func:`triton_ragged_decode` is registered as the op's CUDA kernel and CUDA is
marked fast (:func:`criticalkv.ops.mark_fast`), so the storages attend through the op there. On
the CPU the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before this
module is imported), which is how the tests check them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from criticalkv.ops.ragged_decode import mark_fast
from criticalkv.ops.reference import check_in_pool, check_layout

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # criticalkv imports without triton; the op keeps its torch reference
    triton = None
    logger.debug("triton is not installed: the ragged decode op has no Triton kernel")


def _jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` (which reads ``TRITON_INTERPRET`` now), or ``fn`` as it is without triton."""
    return fn if triton is None else triton.jit(fn)


#: at most this many splits of one sequence (the partial results are (S, splits, Q, D) float32)
MAX_SPLITS = 64


@_jit
def _entries(ptr, rows, j, live, width, HALF: tl.constexpr, BITS: tl.constexpr):
    """float32 (N, H) of channels ``2j + HALF`` at pool ``rows``: entries or codes (4 bits: the
    low nibble of byte ``j`` for the even channel, the high one for the odd)."""
    cols = j if BITS == 4 else 2 * j + HALF
    x = tl.load(ptr + rows[:, None] * width + cols[None, :], mask=live[:, None] & (cols < width)[None, :], other=0)
    if BITS == 4:
        x = x >> 4 if HALF == 1 else x & 15
    return x.to(tl.float32)


@_jit
def _half(ptr, scale_ptr, zero_ptr, rows, stat_rows, j, live, width, D, group, HALF: tl.constexpr, BITS: tl.constexpr):
    """Dequantized float32 (N, H) channels ``2j + HALF`` at ``rows``: codes as ``c * scale + zero``
    with the statistics at (``stat_rows``, channel // ``group``); 16-bit entries as they are."""
    x = _entries(ptr, rows, j, live, width, HALF, BITS)
    if BITS != 16:
        ch = 2 * j + HALF
        at = stat_rows[:, None] * (D // group) + (ch // group)[None, :]
        mask = live[:, None] & (ch < D)[None, :]
        scale = tl.load(scale_ptr + at, mask=mask, other=0).to(tl.float32)
        zero = tl.load(zero_ptr + at, mask=mask, other=0).to(tl.float32)
        x = x * scale + zero
    return x


@_jit
def _query_half(q_ptr, s, rq, j, Q, D, scaling, HALF: tl.constexpr):
    """The sequence's (BLOCK_Q, H) query channels ``2j + HALF``, float32, times ``scaling``."""
    ch = 2 * j + HALF
    mask = (rq < Q)[:, None] & (ch < D)[None, :]
    x = tl.load(q_ptr + (s * Q + rq[:, None]) * D + ch[None, :], mask=mask, other=0)
    return x.to(tl.float32) * scaling


@_jit
def _online(m, lsum, acc_e, acc_o, scores, ve, vo):
    """One tile into the online softmax: running max ``m``, sum ``lsum``, weighted values (even, odd);
    a row with nothing attended so far stays at -inf, 0, 0 (no NaN)."""
    top = tl.maximum(m, tl.max(scores, 1))
    base = tl.where(top == float("-inf"), 0.0, top)
    p = tl.exp(scores - base[:, None])
    alpha = tl.exp(m - base)
    lsum = lsum * alpha + tl.sum(p, 1)
    acc_e = acc_e * alpha[:, None] + tl.dot(p, ve, input_precision="ieee")
    acc_o = acc_o * alpha[:, None] + tl.dot(p, vo, input_precision="ieee")
    return top, lsum, acc_e, acc_o


@_jit
def _scores(qe, qo, ke, ko):
    """(BLOCK_Q, N) float32 scores from the two channel halves."""
    return tl.dot(qe, tl.trans(ke), input_precision="ieee") + tl.dot(qo, tl.trans(ko), input_precision="ieee")


@_jit
def _pool_split(qe, qo, m, lsum, acc_e, acc_o, s, k, kp_ptr, vp_ptr, table_ptr, len_ptr, starts_ptr,
                ks_ptr, kz_ptr, vs_ptr, vz_ptr, D, width, M, block_size, split_entries, group,
                BITS: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_H: tl.constexpr):  # fmt: skip
    """Split ``k`` of sequence ``s``'s pool entries, cut at its length, into the online softmax."""
    lo = k * split_entries
    hi = tl.minimum(lo + split_entries, tl.load(len_ptr + s))
    j = tl.arange(0, BLOCK_H)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < hi
        blk = tl.load(table_ptr + s * M + n // block_size, mask=live, other=0).to(tl.int64)
        if HAS_STARTS:
            rows = tl.load(starts_ptr + blk, mask=live, other=0).to(tl.int64) + n % block_size
        else:
            rows = blk * block_size + n % block_size
        ke = _half(kp_ptr, ks_ptr, kz_ptr, rows, blk, j, live, width, D, 1, 0, BITS)
        ko = _half(kp_ptr, ks_ptr, kz_ptr, rows, blk, j, live, width, D, 1, 1, BITS)
        ve = _half(vp_ptr, vs_ptr, vz_ptr, rows, rows, j, live, width, D, group, 0, BITS)
        vo = _half(vp_ptr, vs_ptr, vz_ptr, rows, rows, j, live, width, D, group, 1, BITS)
        scores = tl.where(live[None, :], _scores(qe, qo, ke, ko), float("-inf"))
        m, lsum, acc_e, acc_o = _online(m, lsum, acc_e, acc_o, scores, ve, vo)
    return m, lsum, acc_e, acc_o


@_jit
def _tail_split(qe, qo, m, lsum, acc_e, acc_o, s, rq, tk_ptr, tv_ptr, tm_ptr, Q, D, T,
                HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """Sequence ``s``'s dense tail of ``T`` entries under its (Q, T) mask into the online softmax."""
    j = tl.arange(0, BLOCK_H)
    for t0 in range(0, T, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        live = t < T
        rows = s * T + t
        ke = _half(tk_ptr, tk_ptr, tk_ptr, rows, rows, j, live, D, D, 1, 0, 16)
        ko = _half(tk_ptr, tk_ptr, tk_ptr, rows, rows, j, live, D, D, 1, 1, 16)
        ve = _half(tv_ptr, tv_ptr, tv_ptr, rows, rows, j, live, D, D, 1, 0, 16)
        vo = _half(tv_ptr, tv_ptr, tv_ptr, rows, rows, j, live, D, D, 1, 1, 16)
        seen = (rq < Q)[:, None] & live[None, :]
        if HAS_MASK:
            shown = tl.load(tm_ptr + (s * Q + rq[:, None]) * T + t[None, :], mask=seen, other=0)
            seen = seen & (shown != 0)
        scores = tl.where(seen, _scores(qe, qo, ke, ko), float("-inf"))
        m, lsum, acc_e, acc_o = _online(m, lsum, acc_e, acc_o, scores, ve, vo)
    return m, lsum, acc_e, acc_o


@_jit
def _split_kernel(q_ptr, kp_ptr, vp_ptr, table_ptr, len_ptr, starts_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                  tk_ptr, tv_ptr, tm_ptr, m_ptr, l_ptr, acc_ptr, scaling, Q, D, width, M, T, block_size,
                  split_entries, n_splits, group, BITS: tl.constexpr, HAS_STARTS: tl.constexpr,
                  HAS_MASK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_H: tl.constexpr):  # fmt: skip
    """Program (s, k): split ``k`` of sequence ``s`` (the tail if ``k == n_splits``) into the
    partial results ``m``, ``lsum`` (S, K, Q) and ``acc`` (S, K, Q, D), float32."""
    s = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    rq = tl.arange(0, BLOCK_Q)
    j = tl.arange(0, BLOCK_H)
    qe = _query_half(q_ptr, s, rq, j, Q, D, scaling, 0)
    qo = _query_half(q_ptr, s, rq, j, Q, D, scaling, 1)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_Q], tl.float32)
    acc_e = tl.zeros([BLOCK_Q, BLOCK_H], tl.float32)
    acc_o = tl.zeros([BLOCK_Q, BLOCK_H], tl.float32)
    if k < n_splits:
        m, lsum, acc_e, acc_o = _pool_split(qe, qo, m, lsum, acc_e, acc_o, s, k, kp_ptr, vp_ptr, table_ptr, len_ptr,
                                         starts_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, D, width, M, block_size,
                                         split_entries, group, BITS, HAS_STARTS, BLOCK_N, BLOCK_H)  # fmt: skip
    else:
        m, lsum, acc_e, acc_o = _tail_split(qe, qo, m, lsum, acc_e, acc_o, s, rq, tk_ptr, tv_ptr, tm_ptr, Q, D, T,
                                         HAS_MASK, BLOCK_N, BLOCK_H)  # fmt: skip
    row = (s * tl.num_programs(1) + k) * Q + rq
    live = rq < Q
    tl.store(m_ptr + row, m, mask=live)
    tl.store(l_ptr + row, lsum, mask=live)
    ch = 2 * j
    tl.store(acc_ptr + row[:, None] * D + ch[None, :], acc_e, mask=live[:, None] & (ch < D)[None, :])
    tl.store(acc_ptr + row[:, None] * D + ch[None, :] + 1, acc_o, mask=live[:, None] & (ch + 1 < D)[None, :])


@_jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, Q, D, K, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program s: the K partial results of sequence ``s`` rescaled to their common maximum and
    summed; out = acc / lsum in the output's dtype (zeros where nothing was attended)."""
    s = tl.program_id(0).to(tl.int64)
    rq = tl.arange(0, BLOCK_Q)
    rd = tl.arange(0, BLOCK_D)
    live = rq < Q
    mask = live[:, None] & (rd < D)[None, :]
    top = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    for k in range(K):
        top = tl.maximum(top, tl.load(m_ptr + (s * K + k) * Q + rq, mask=live, other=float("-inf")))
    base = tl.where(top == float("-inf"), 0.0, top)
    num = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_Q], tl.float32)
    for k in range(K):
        row = (s * K + k) * Q + rq
        w = tl.exp(tl.load(m_ptr + row, mask=live, other=float("-inf")) - base)
        den += w * tl.load(l_ptr + row, mask=live, other=0.0)
        num += w[:, None] * tl.load(acc_ptr + row[:, None] * D + rd[None, :], mask=mask, other=0.0)
    out = num / tl.where(den > 0, den, 1.0)[:, None]  # den 0: nothing attended, num is 0 too
    tl.store(out_ptr + (s * Q + rq[:, None]) * D + rd[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _pow2(n: int, least: int = 16) -> int:
    """The next power of two at least ``n`` and ``least`` (``tl.dot`` wants 16 or more)."""
    return max(least, 1 << max(0, n - 1).bit_length())


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def split_plan(sequences: int, capacity: int, head_dim: int, device: torch.device) -> tuple[int, int, int]:
    """``(tile, entries per split, splits)`` for ``sequences`` sequences of at most ``capacity``
    entries (the block table's width times the block size: no device sync to learn the lengths).

    About two programs per multiprocessor on CUDA (a long sequence is split so the GPU fills even
    at batch 1), about eight on the CPU (the interpreter: small tiles, a few splits, so the tests
    take every path); a split is at least one tile (four on CUDA), at most :data:`MAX_SPLITS`."""
    if device.type == "cuda":
        tile, least, programs = (64 if head_dim <= 64 else 32), 4, 2 * _multiprocessors(device.index or 0)
    else:
        tile, least, programs = 16, 1, 8
    tiles = max(1, -(-capacity // tile))
    wanted = min(MAX_SPLITS, max(1, -(-programs // max(1, sequences))))
    per_split = max(least, -(-tiles // wanted))
    return tile, per_split * tile, -(-tiles // per_split)


def _check_quantized(
    d: int, bits: int, stats: list[torch.Tensor | None], value_group: int, entry_starts: torch.Tensor | None
) -> int:
    """The value group (channels a value statistic covers), the quantized arguments checked."""
    if entry_starts is not None and (entry_starts.dim() != 1 or entry_starts.dtype != torch.int32):
        raise ValueError(f"entry_starts must be (NB,) int32, not {tuple(entry_starts.shape)} {entry_starts.dtype}")
    group = value_group or d
    if bits != 16 and any(t is None for t in stats):
        raise ValueError(f"{bits}-bit codes need their scales and zero points")
    if bits != 16 and d % group:
        raise ValueError(f"value_group {group} must divide the head dimension {d}")
    return group


def interpreted() -> bool:
    """Whether this module's kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` was set
    when it was imported)."""
    return triton is not None and type(_split_kernel).__name__ == "InterpretedFunction"


def _check_device(device: torch.device) -> None:
    """A ``ValueError`` for CPU tensors unless the kernels are interpreted (Triton has no CPU driver)."""
    if device.type != "cuda" and not interpreted():
        raise ValueError(
            f"the Triton kernel runs on CUDA tensors, or on CPU tensors only under Triton's interpreter "
            f"(TRITON_INTERPRET=1 set before criticalkv is imported), not on {device.type} tensors; "
            "call criticalkv.ops.ragged_decode, which runs the CPU kernel there"
        )


def triton_ragged_decode(
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
    """Decode attention over the ragged paged layout of :mod:`criticalkv.ops.ragged_decode` (same
    arguments, same result as its reference within float32 rounding), with the Triton kernels of
    this module: on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    if triton is None:
        raise RuntimeError("triton_ragged_decode needs triton (pip install triton)")
    _check_device(query.device)
    check_layout(query, key_pool, value_pool, block_table, lengths, block_size, tail_keys, tail_values, tail_mask, bits)
    s, q, d = query.shape
    stats = [key_scale, key_zero, value_scale, value_zero]
    group = _check_quantized(d, bits, stats, value_group, entry_starts)
    check_in_pool(block_table, lengths, block_size, int(key_pool.shape[0]), entry_starts)
    out = torch.empty((s, q, d), dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    tile, split_entries, n_splits = split_plan(s, int(block_table.shape[1]) * block_size, d, query.device)
    t = 0 if tail_keys is None else int(tail_keys.shape[1])
    k = n_splits + (t > 0)
    m = torch.empty((s, k, q), dtype=torch.float32, device=query.device)
    lsum, acc = torch.empty_like(m), torch.empty((s, k, q, d), dtype=torch.float32, device=query.device)
    dummy = query
    args = [x.contiguous() if x is not None else dummy for x in (query, key_pool, value_pool, block_table, lengths)]
    args += [x.contiguous() if x is not None else dummy for x in (entry_starts, *stats, tail_keys, tail_values)]
    args.append(dummy if tail_mask is None else tail_mask.contiguous().view(torch.uint8))
    _split_kernel[(s, k)](
        *args, m, lsum, acc, float(scaling), q, d, int(key_pool.shape[1]), int(block_table.shape[1]), t, block_size,
        split_entries, n_splits, group, BITS=bits, HAS_STARTS=entry_starts is not None,
        HAS_MASK=tail_mask is not None, BLOCK_Q=_pow2(q), BLOCK_N=tile, BLOCK_H=_pow2(-(-d // 2)),
    )  # fmt: skip
    _merge_kernel[(s,)](m, lsum, acc, out, q, d, k, BLOCK_Q=_pow2(q, 1), BLOCK_D=_pow2(d, 1))
    return out


def _register() -> None:
    """The op's CUDA kernel is :func:`triton_ragged_decode`; CUDA is marked fast."""
    torch.library.register_kernel("criticalkv::ragged_decode", "cuda")(triton_ragged_decode)
    mark_fast("cuda")


if triton is not None:
    _register()
