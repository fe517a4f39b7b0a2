"""Decode-time attention over a ragged prefix plus a dense tail, merged by online softmax."""

from __future__ import annotations

import torch

from criticalkv.cache.tiers import Tier


def _merge(m: torch.Tensor, lse: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, values: torch.Tensor) -> None:
    """Fold one block of ``scores`` (n, q, L) and ``values`` (n, L, d) into the running
    max ``m`` (n, q), normaliser ``lse`` (n, q) and output ``acc`` (n, q, d), in place."""
    block_max = scores.amax(dim=-1)
    new_m = torch.maximum(m, block_max)
    new_m = torch.where(torch.isfinite(new_m), new_m, torch.zeros_like(new_m))
    p = torch.exp(scores - new_m[..., None])
    rescale = torch.exp(m - new_m)
    lse.mul_(rescale).add_(p.sum(-1))
    acc.mul_(rescale[..., None]).add_(torch.matmul(p.to(values.dtype), values).float())
    m.copy_(new_m)


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
    m = torch.full((s, nq), float("-inf"), dtype=torch.float32, device=query.device)
    lse = torch.zeros((s, nq), dtype=torch.float32, device=query.device)
    acc = torch.zeros((s, nq, d), dtype=torch.float32, device=query.device)
    for tier in tiers:
        n = tier.num_segments
        scores = torch.matmul(query[:n], tier.keys.transpose(1, 2)).float() * scaling
        _merge(m[:n], lse[:n], acc[:n], scores, tier.values)
    if tail_keys is not None and tail_values is not None and tail_keys.shape[1] > 0:
        scores = torch.matmul(query, tail_keys.transpose(1, 2)).float() * scaling
        if tail_mask is not None:
            scores = scores.masked_fill(~tail_mask, float("-inf"))
        _merge(m, lse, acc, scores, tail_values)
    return (acc / lse[..., None]).to(query.dtype)
