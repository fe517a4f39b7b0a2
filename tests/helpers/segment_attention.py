"""Decode attention the straightforward way, segment by segment, for the quantized-kernel oracles.

Every segment's stored entries (already dequantized), then its tail and its residual, one softmax
per segment over them, times the values.
"""

from __future__ import annotations

import torch


def attend_segments(
    query: torch.Tensor,
    prefix_kv: tuple[torch.Tensor, torch.Tensor],
    lengths: list[int],
    tail_kv: tuple[torch.Tensor, torch.Tensor] | None,
    residual: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """(S, Q, d) outputs in original segment order: segment ``s`` attends over its first
    ``lengths[s]`` prefix entries, its tail (``tail_kv``, dense) and its residual; ``mask`` (S, Q, t)
    over the tail and residual, ``None`` for all allowed. A row with nothing allowed gives zeros."""
    outs = []
    for s, n in enumerate(lengths):
        keys, values = [prefix_kv[0][s, :n]], [prefix_kv[1][s, :n]]
        if tail_kv is not None:
            keys.append(tail_kv[0][s])
            values.append(tail_kv[1][s])
        keys.append(residual[0][s])
        values.append(residual[1][s])
        k, v = torch.cat(keys), torch.cat(values)
        scores = query[s] @ k.T * scaling
        if mask is not None:
            allowed = torch.cat([torch.ones(query.shape[1], n, dtype=torch.bool), mask[s]], dim=-1)
            scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.softmax(scores, -1).nan_to_num(0.0) @ v)
    return torch.stack(outs)
