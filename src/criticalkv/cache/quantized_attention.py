"""Decode attention over quantized blocks, dequantized tile by tile, merged by an online softmax.

Each tile (at most ``tile_blocks`` blocks of one tier, the quantized tail, the full-precision
residual) is dequantized, scored and folded into a running maximum ``m``, normaliser ``l`` and
output accumulator per query row (Milakov and Gimelshein 2018, "Online normalizer calculation for
softmax", arXiv 1805.02867; the merge of FlashAttention, Dao et al. 2022):
``m' = max(m, max_j s_j)``, ``l' = l e^{m - m'} + sum_j e^{s_j - m'}``,
``o' = o e^{m - m'} + sum_j e^{s_j - m'} v_j``; the result is ``o / l``. Only one tile is ever
held in full precision, never the whole layer.
"""

from __future__ import annotations

import torch

from criticalkv.cache.quantized_store import QuantizedBlocks

#: blocks per tile (times the group size: entries dequantized at once per segment)
TILE_BLOCKS = 8


class OnlineSoftmax:
    """The running (max, normaliser, output) of softmax attention for (S, Q) query rows."""

    def __init__(self, query: torch.Tensor, scaling: float) -> None:
        s, nq, d = query.shape
        self.query = query * scaling
        self.m = torch.full((s, nq), float("-inf"), dtype=torch.float32, device=query.device)
        self.l = torch.zeros((s, nq), dtype=torch.float32, device=query.device)
        self.acc = torch.zeros((s, nq, d), dtype=torch.float32, device=query.device)

    def add(self, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None) -> None:
        """Fold (n, w, d) keys/values of the first ``n`` rows in; ``allowed`` (n, Q or 1, w) bool or ``None``."""
        n = int(keys.shape[0])
        scores = torch.matmul(self.query[:n], keys.transpose(1, 2)).float()
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        m_old = self.m[:n]
        m_new = torch.maximum(m_old, scores.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with nothing yet
        probs = torch.exp(scores - safe[..., None])
        correction = torch.exp(m_old - safe)
        self.l[:n] = self.l[:n] * correction + probs.sum(-1)
        mixed = torch.matmul(probs.to(values.dtype), values).float()
        self.acc[:n] = self.acc[:n] * correction[..., None] + mixed
        self.m[:n] = m_new

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.acc / self.l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).to(dtype)


def add_blocks(
    softmax: OnlineSoftmax,
    blocks: QuantizedBlocks,
    used: int,
    dtype: torch.dtype,
    mask: torch.Tensor | None = None,
    tile_blocks: int | None = None,
) -> None:
    """Fold the first ``used`` blocks in, ``tile_blocks`` (default :data:`TILE_BLOCKS`) at a time.

    ``mask`` is (n, Q, used * G) bool over the blocks' columns (True = attend), or ``None``; the
    blocks' own padding (``blocks.valid``) is masked as well.
    """
    g = blocks.group
    step = TILE_BLOCKS if tile_blocks is None else tile_blocks
    for start in range(0, used, step):
        stop = min(used, start + step)
        keys, values = blocks.dequantize(start, stop, dtype)
        allowed = None
        valid = blocks.valid_columns(start, stop)
        if valid is not None:
            allowed = valid[:, None, :]
        if mask is not None:
            cols = mask[:, :, start * g : stop * g]
            allowed = cols if allowed is None else allowed & cols
        softmax.add(keys, values, allowed)


def quantized_attention(
    query: torch.Tensor,
    prefix: list[QuantizedBlocks],
    tail_blocks: QuantizedBlocks | None,
    tail_used: int,
    residual_keys: torch.Tensor | None,
    residual_values: torch.Tensor | None,
    tail_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Attention of sorted-segment queries (S, Q, d) over a quantized prefix and a decode tail.

    Parameters
    ----------
    query : (S, Q, d), in sorted segment order (``Q = G_heads * q``).
    prefix : the prefix tiers; tier ``j`` covers the first ``prefix[j].num_segments`` segments.
    tail_blocks, tail_used : the quantized part of the tail (all ``S`` segments) and its blocks in use.
    residual_keys, residual_values : (S, r, d) the full-precision residual, or ``None``.
    tail_mask : (S, Q, t) bool over the whole tail (quantized blocks, then the residual), or ``None``.
    scaling : softmax scale.

    Returns
    -------
    (S, Q, d) in ``query.dtype``.
    """
    dtype = query.dtype
    softmax = OnlineSoftmax(query, scaling)
    for tier in prefix:
        add_blocks(softmax, tier, tier.num_blocks, dtype)
    quantized = 0
    if tail_blocks is not None and tail_used:
        quantized = tail_used * tail_blocks.group
        add_blocks(softmax, tail_blocks, tail_used, dtype, None if tail_mask is None else tail_mask[:, :, :quantized])
    if residual_keys is not None and residual_values is not None and residual_keys.shape[1]:
        allowed = None if tail_mask is None else tail_mask[:, :, quantized:]
        softmax.add(residual_keys, residual_values, allowed)
    return softmax.result(dtype)
