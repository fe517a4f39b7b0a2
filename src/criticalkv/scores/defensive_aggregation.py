"""DefensiveKV's defensive aggregation of window attention (Feng et al. 2025, "Taming the Fragility
of KV Cache Eviction in LLM Inference", arXiv 2510.13334)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from criticalkv.scores.base import Scorer
from criticalkv.scores.window_attention import window_attention_rows
from criticalkv.state import LayerState


@dataclass(frozen=True)
class DefensiveAggregation(Scorer):
    """Worst case over the observation window instead of its mean, floored at the head's mean.

    SnapKV-style scores average an entry's attention over the window queries (and the query
    heads of a GQA group), trusting that the entries those queries need are the ones future
    queries will need. DefensiveKV guards against the queries that disagree:

    1. every window query of every query head is softmaxed over all keys (float32, causal inside
       the window, padding masked) and its row over the entries outside the window is smoothed
       with an average pool of ``kernel``, then rescaled so that the row keeps its mass there
       (mass-preserving pooling);
    2. an entry's score is the **maximum** over the window queries and the query heads of its
       KV group (not the mean);
    3. each KV head's scores are clamped from below at their mean over the head's entries, so
       entries no query wants still rank by what the selection adds to the score (the value
       norms of :class:`~criticalkv.select.AdaptiveCritical`).

    Steps 2-3 are the paper's two-line "defensive aggregation"; the released code
    (``EfficientDefensiveKVPress.score``) does the same on one unpadded row. Here the pooling
    mass and the mean are taken over the row's real tokens, so a left-padded row scores as it
    would alone. The window's own entries (always kept) score 0.

    Parameters
    ----------
    kernel : average-pooling kernel, odd (5 in the released code; 1 disables pooling).
    """

    kernel: int = 5

    def __post_init__(self) -> None:
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd integer, not {self.kernel!r}")

    def __call__(self, state: LayerState) -> torch.Tensor:
        key = ("defensive_aggregation", self.kernel, state.window)
        return state.remember(key, lambda: self._scores(state))

    def per_query_attention(self, state: LayerState) -> torch.Tensor:
        """(B, H_kv, G, w, T - w) pooled attention of each window query on the non-window entries."""
        body = state.seq_len - state.window
        weights = window_attention_rows(state)[..., :body]
        if self.kernel == 1 or body == 0:
            return weights
        real = state.held[:, :, None, None, :body]
        mass = weights.sum(-1, keepdim=True)  # padding columns hold no attention
        pooled = F.avg_pool1d(weights.reshape(-1, 1, body), self.kernel, stride=1, padding=self.kernel // 2)
        pooled = pooled.view_as(weights) * real  # what spills onto padding is not the row's
        total = pooled.sum(-1, keepdim=True)
        scale = torch.where(total > 0, mass / total.clamp_min(torch.finfo(total.dtype).tiny), torch.zeros_like(total))
        return pooled * scale

    def _scores(self, state: LayerState) -> torch.Tensor:
        b, h_kv, t, _ = state.keys.shape
        body = t - state.window
        out = torch.zeros(b, h_kv, t, dtype=torch.float32, device=state.keys.device)
        if body == 0:
            return out
        worst = self.per_query_attention(state).amax(dim=(2, 3))  # (B, H_kv, T - w)
        real = state.held[..., :body]
        count = real.sum(-1, keepdim=True).clamp_min(1)
        mean = (worst * real).sum(-1, keepdim=True) / count
        out[..., :body] = torch.maximum(worst, mean)
        return out
