"""Decode-time attention over a ragged prefix plus a dense tail, with one softmax.

The scores of every tier and of the tail are written side by side into one (S, Q, total)
buffer (``-inf`` where a segment has no entries), softmaxed once in float32, and each block's
probabilities multiply its values. The buffer is per query row, so its size is
``S * Q * (longest segment + tail)`` floats: small next to the keys and values read.
"""

from __future__ import annotations

import torch

from criticalkv.cache.layouts.tiers import Tier


def ragged_attention(
    query: torch.Tensor,
    tiers: list[Tier],
    tail_keys: torch.Tensor | None,
    tail_values: torch.Tensor | None,
    tail_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Attention of sorted-segment queries over tiers and a tail.

    Parameters
    ----------
    query : (S, Q, d) queries per segment (``Q = G * q``), in sorted segment order.
    tiers : prefix tiers; tier ``j`` covers the first ``tiers[j].num_segments`` segments.
    tail_keys, tail_values : (S, t, d) appended entries of every segment, or ``None``.
    tail_mask : (S, Q, t) bool (True = attend), or ``None`` for no masking.
    scaling : softmax scale.

    Returns
    -------
    (S, Q, d) in ``query.dtype``.
    """
    s, nq, d = query.shape
    tail = 0 if tail_keys is None or tail_values is None else int(tail_keys.shape[1])
    widths = [int(tier.keys.shape[1]) for tier in tiers]
    total = sum(widths) + tail
    q = query * scaling
    scores = torch.full((s, nq, total), float("-inf"), dtype=torch.float32, device=query.device)
    offset = 0
    for tier, width in zip(tiers, widths, strict=True):
        n = tier.num_segments
        scores[:n, :, offset : offset + width] = torch.matmul(q[:n], tier.keys.transpose(1, 2))
        offset += width
    if tail:
        assert tail_keys is not None
        block = torch.matmul(q, tail_keys.transpose(1, 2)).float()
        if tail_mask is not None:
            block = block.masked_fill(~tail_mask, float("-inf"))
        scores[:, :, offset:] = block
    probs = torch.softmax(scores, dim=-1)
    if probs.dtype != query.dtype:
        probs = probs.to(query.dtype)
    out = torch.zeros((s, nq, d), dtype=torch.float32, device=query.device)
    offset = 0
    for tier, width in zip(tiers, widths, strict=True):
        n = tier.num_segments
        out[:n] += torch.matmul(probs[:n, :, offset : offset + width], tier.values)
        offset += width
    if tail:
        assert tail_values is not None
        out += torch.matmul(probs[:, :, offset:], tail_values)
    return out.to(query.dtype)
