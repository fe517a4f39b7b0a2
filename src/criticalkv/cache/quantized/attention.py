"""Decode attention over quantized storage, computed one tile of whole segments at a time.

A tile (:mod:`~criticalkv.cache.quantized.plan`) is a run of consecutive segments, each with the
same slots: its prefix blocks gathered from the pool (:mod:`~criticalkv.cache.quantized.pool`),
the quantized tail's blocks, the full-precision residual. Per tile, the key codes are unpacked
into one float32 workspace, the key scale and zero point applied (per channel and block), the
residual keys copied beside them; the scores are one batched product (segments as the batch),
masked (padding, and the tail's attention mask) and softmaxed in one call. Then the same
workspace takes the values (per-token scale and zero point, KIVI's grouping: Liu et al. 2024,
arXiv 2402.02750) and the output is one more batched product. Each segment lies wholly in one
tile, so its softmax is exact without merging, and only one tile is ever held in float32.

4-bit codes are unpacked in *halves*, even channels then odd ones (``lo = byte & 15``,
``hi = byte >> 4``), so that both unpacked halves are contiguous; the query is split the same
way (``q . k = q_even . k_even + q_odd . k_odd``) and the output halves are interleaved back.
The kernel's parts are module functions (:func:`gather`, :func:`unpack`, :func:`scale`,
:func:`matmul`, :func:`softmax`) so a benchmark can time them one by one.
"""

from __future__ import annotations

import torch

from criticalkv.cache.quantized.blocks import QuantizedBlocks
from criticalkv.cache.quantized.plan import DecodePlan, Tile
from criticalkv.cache.quantized.pool import PrefixPool


def halves_of(t: torch.Tensor, halves: int) -> torch.Tensor:
    """(..., d) -> (halves, ..., d / halves), channel ``halves j + h`` at ``[h, ..., j]`` (a view)."""
    return t.unflatten(-1, (-1, halves)).movedim(-1, 0)


def gather(pool: PrefixPool, tile: Tile, values: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile's prefix slots from the pool: codes (n, slots, bytes), scale and zero point as
    float32 (keys: (n, nbp, 1, d) per block; values: (n, slots, groups) per entry)."""
    n = tile.last - tile.first
    if values:
        stats = (pool.value_scale, pool.value_zero)
        codes = pool.value_codes.index_select(0, tile.entry_rows).view(n, -1, pool.value_codes.shape[-1])
        s, z = (t.index_select(0, tile.entry_rows).view(n, -1, t.shape[-1]).float() for t in stats)
        return codes, s, z
    codes = pool.key_codes.index_select(0, tile.entry_rows).view(n, -1, pool.key_codes.shape[-1])
    stats = (pool.key_scale, pool.key_zero)
    s, z = (t.index_select(0, tile.block_rows).view(n, tile.nbp, 1, -1).float() for t in stats)
    return codes, s, z


def unpack(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """(n, m, bytes) uint8 codes -> ``out`` (halves, n, m, d / halves) float32, in halves (8 bits: one)."""
    if bits == 8:
        out[0].copy_(codes)
        return
    out[0].copy_(codes & 15)
    out[1].copy_(codes >> 4)


def scale(work: torch.Tensor, s: torch.Tensor, z: torch.Tensor, keys: bool) -> None:
    """Codes in ``work`` (halves, n, m, w) -> keys or values in place: ``codes * s + z``.

    Keys: ``s``/``z`` (n, m / G, 1, d), per channel and block of ``G``; values: (n, m, groups), per
    entry and group of ``d / groups`` channels.
    """
    halves = int(work.shape[0])
    if keys:
        view = work.unflatten(2, (s.shape[1], -1))
        view.mul_(halves_of(s, halves)).add_(halves_of(z, halves))
        return
    groups = int(s.shape[-1])
    width = halves * int(work.shape[-1]) // groups  # channels per value group
    if width % halves == 0:  # both halves of a group's channels share its statistics
        view = work.unflatten(-1, (groups, -1))
        view.mul_(s[..., None]).add_(z[..., None])
    else:
        work.mul_(halves_of(s.repeat_interleave(width, -1), halves))
        work.add_(halves_of(z.repeat_interleave(width, -1), halves))


def matmul(rows: torch.Tensor, work: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Scores ``bias + sum_h rows[h] work[h]^T`` (``rows`` (halves, n, Q, w)), or with ``bias``
    ``None`` the output: ``rows`` (n, Q, m) probabilities times each half, interleaved to (n, Q, d)."""
    if bias is not None:
        scores = torch.baddbmm(bias, rows[0], work[0].transpose(1, 2))
        for h in range(1, int(work.shape[0])):
            scores.baddbmm_(rows[h], work[h].transpose(1, 2))
        return scores
    if work.shape[0] == 1:
        return torch.bmm(rows, work[0])
    return torch.stack([torch.bmm(rows, half) for half in work], dim=-1).flatten(-2)


def softmax(scores: torch.Tensor, may_be_empty: bool) -> torch.Tensor:
    """Softmax over the last dimension; a row with nothing to attend to (all ``-inf``) gives zeros."""
    probs = torch.softmax(scores, dim=-1)
    return probs.nan_to_num_(0.0) if may_be_empty else probs


def quantized_attention(
    query: torch.Tensor,
    pool: PrefixPool | None,
    decode_plan: DecodePlan,
    tail: QuantizedBlocks | None,
    residual_keys: torch.Tensor | None,
    residual_values: torch.Tensor | None,
    tail_mask: torch.Tensor | None,
    scaling: float,
    bits: int,
    group: int,
) -> torch.Tensor:
    """Attention of sorted-segment queries (S, Q, d) over the pooled prefix, the tail and the residual.

    Parameters
    ----------
    query : (S, Q, d), in sorted segment order (``Q = G_heads * q``).
    pool : the pooled prefix (``None``: no prefix entries).
    decode_plan : :func:`~criticalkv.cache.quantized.plan.plan` of this layer.
    tail : the quantized tail (all ``S`` segments, ``decode_plan.tail_used`` blocks in use), or ``None``.
    residual_keys, residual_values : (S, r, d) the full-precision residual, or ``None``.
    tail_mask : (S, Q, t) bool over the whole tail (quantized blocks, then the residual), or ``None``.
    scaling : softmax scale.
    bits, group : the storage's bits and group size.

    Returns
    -------
    (S, Q, d) in ``query.dtype``.
    """
    halves = 2 if bits == 4 else 1
    d = int(query.shape[-1])
    used = decode_plan.tail_used if tail is not None else 0
    r = 0 if residual_keys is None else int(residual_keys.shape[1])
    rows = halves_of(query.float() * scaling, halves).contiguous()
    outs = []
    for tile in decode_plan.tiles:
        a, b = tile.first, tile.last
        lp = tile.nbp * group
        lq = lp + used * group
        work = torch.empty(halves, b - a, lq + r, d // halves, device=query.device)
        for values in (False, True):
            if lp:
                assert pool is not None
                codes, s, z = gather(pool, tile, values)
                unpack(codes, bits, work[:, :, :lp])
                scale(work[:, :, :lp], s, z, keys=not values)
            if used:
                assert tail is not None
                parts = (tail.value_codes, tail.value_scale, tail.value_zero) if values else tail.parts()[:3]
                tc, ts, tz = (t[a:b, :used] for t in parts)
                unpack(tc.flatten(1, 2), bits, work[:, :, lp:lq])
                scale(
                    work[:, :, lp:lq],
                    ts.flatten(1, 2) if values else ts,
                    tz.flatten(1, 2) if values else tz,
                    not values,
                )
            residual = residual_values if values else residual_keys
            if r and residual is not None:
                work[:, :, lq:].copy_(halves_of(residual[a:b], halves))
            if not values:
                scores = matmul(rows[:, a:b], work, tile.bias[..., : lq + r])
                if tail_mask is not None:
                    scores[..., lp:].masked_fill_(~tail_mask[a:b], float("-inf"))
                probs = softmax(scores, tail_mask is not None or tile.has_empty)
        outs.append(matmul(probs, work, None))
    result = outs[0] if len(outs) == 1 else torch.cat(outs)
    return result.to(query.dtype)
