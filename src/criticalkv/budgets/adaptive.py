"""AdaKV's adaptive cross-head budgets (Feng et al. 2024, arXiv 2407.11550)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.budgets.base import Allocator
from criticalkv.select.topk import topk_mask
from criticalkv.state import LayerState


@dataclass(frozen=True)
class Adaptive(Allocator):
    """Per-head budgets from the layer's globally highest scores, with a per-head safeguard.

    Each head first keeps ``max(1, floor(alpha_floor * b))`` entries (its window counts
    there); the rest of the row's ``H_kv * b`` entries go to the highest remaining scores
    across all heads of the layer. A head's budget is the count that lands in it.
    """

    alpha_floor: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha_floor <= 1.0:
            raise ValueError(f"alpha_floor must be in [0, 1], not {self.alpha_floor}")

    def __call__(self, scores: torch.Tensor, state: LayerState, budget: torch.Tensor) -> torch.Tensor:
        b, h, t = scores.shape
        w = state.window
        eligible = state.eligible
        selectable = budget - w  # (B,) per head, outside the window
        safe_total = torch.clamp(torch.floor(self.alpha_floor * budget.double()).long(), min=1)
        safe = torch.minimum(torch.clamp(safe_total - w, min=0), selectable)
        guaranteed = topk_mask(scores, safe[:, None].expand(b, h), eligible)
        remaining = h * selectable - guaranteed.sum(dim=(1, 2))
        rest_eligible = (eligible & ~guaranteed).reshape(b, h * t)
        extra = topk_mask(scores.reshape(b, h * t), remaining, rest_eligible).view(b, h, t)
        return w + guaranteed.sum(-1) + extra.sum(-1)
