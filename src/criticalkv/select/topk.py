"""Top-k selection with per-row k."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.select.base import Selector
from criticalkv.state import LayerState


def topk_mask(scores: torch.Tensor, k: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Mark the ``k`` highest eligible scores of each row.

    Parameters
    ----------
    scores : (..., N) float.
    k : (...) int64, how many to take per row (clamped to the eligible count).
    eligible : (..., N) bool.

    Returns
    -------
    (..., N) bool with ``min(k, eligible.sum(-1))`` ``True`` per row, all eligible.
    """
    n = scores.shape[-1]
    k = torch.clamp(k.long(), min=0)
    k_max = min(int(k.max()) if k.numel() else 0, n)
    mask = torch.zeros_like(eligible)
    if k_max == 0:
        return mask
    # eligible entries rank strictly above ineligible ones, even where their score is -inf
    lowest = torch.finfo(torch.float32).min
    masked = scores.float().clamp(min=lowest).masked_fill(~eligible, float("-inf"))
    top = torch.topk(masked, k_max, dim=-1, sorted=True).indices
    take = torch.arange(k_max, device=scores.device) < k.unsqueeze(-1)
    mask.scatter_(-1, top, take)
    return mask & eligible


@dataclass(frozen=True)
class TopK(Selector):
    """Keep the window plus each head's ``budget - window`` highest-scoring entries."""

    top_ranked: ClassVar[bool] = True

    def __call__(self, scores: torch.Tensor, budgets: torch.Tensor, state: LayerState) -> torch.Tensor:
        chosen = topk_mask(scores, budgets - state.window, state.eligible)
        return chosen | state.window_mask
