"""SnapKV's observation-window attention (Li et al. 2024, arXiv 2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from criticalkv.scores.base import Scorer
from criticalkv.state import LayerState


def window_attention_rows(state: LayerState) -> torch.Tensor:
    """(B, H_kv, G, w, T) float32 attention of each window query over every key: causal inside
    the window (window query ``j`` sits at column ``T - w + j``), padding (and entries a head no
    longer holds, :attr:`LayerState.present`) masked."""
    b, h_kv, t, d = state.keys.shape
    w, g = state.window, state.group_size
    q = state.queries[:, :, -w:, :].reshape(b, h_kv, g * w, d)
    logits = torch.matmul(q, state.keys.transpose(-1, -2)).float() * state.scaling
    logits = logits.view(b, h_kv, g, w, t)
    cols = torch.arange(t, device=logits.device)
    rows = torch.arange(t - w, t, device=logits.device)
    allowed = (cols[None, :] <= rows[:, None])[None, None, None] & state.held[:, :, None, None, :]
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)


@dataclass(frozen=True)
class WindowAttention(Scorer):
    """Attention of the last ``window`` queries, averaged over them, pooled, GQA group mean.

    For each query head the window queries are softmaxed over all keys in float32 (causal
    inside the window, padding masked), averaged over the window, smoothed along the
    sequence with a 1-D pool (outside the window), then averaged over the query heads of
    each KV group (docs/methods.md, "Window attention").

    Parameters
    ----------
    pool : "avg" (kvpress, SnapKV), "max" (the AdaKV/HeadKV code) or "none".
    kernel : pooling kernel size (odd; 5 by default, 7 in the AdaKV code).
    """

    pool: Literal["avg", "max", "none"] = "avg"
    kernel: int = 5

    def __post_init__(self) -> None:
        if self.pool not in ("avg", "max", "none"):
            raise ValueError(f"pool must be 'avg', 'max' or 'none', not {self.pool!r}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd integer, not {self.kernel}")

    def attention(self, state: LayerState) -> torch.Tensor:
        """(B, H_q, T) window-averaged attention per query head, before pooling."""
        b, h_kv, t, _ = state.keys.shape
        weights = window_attention_rows(state).mean(dim=3)  # (B, H_kv, G, T)
        return weights.reshape(b, h_kv * state.group_size, t)

    def smooth(self, weights: torch.Tensor, window: int) -> torch.Tensor:
        """Pool (B, H, T) along the sequence outside the window; the window is left as is."""
        b, h, t = weights.shape
        if self.pool == "none" or self.kernel == 1 or t == window:  # t == window: nothing to pool
            return weights
        body = weights[..., : t - window].reshape(b * h, 1, t - window)
        pad = self.kernel // 2
        if self.pool == "avg":
            pooled = F.avg_pool1d(body, self.kernel, stride=1, padding=pad)
        else:
            pooled = F.max_pool1d(body, self.kernel, stride=1, padding=pad)
        return torch.cat([pooled.view(b, h, t - window), weights[..., t - window :]], dim=-1)

    def __call__(self, state: LayerState) -> torch.Tensor:
        key = ("window_attention", self.pool, self.kernel, state.window)
        return state.remember(key, lambda: self._scores(state))

    def _scores(self, state: LayerState) -> torch.Tensor:
        weights = self.smooth(self.attention(state), state.window)
        b, _, t = weights.shape
        return weights.view(b, state.num_kv_heads, state.group_size, t).mean(dim=2)
