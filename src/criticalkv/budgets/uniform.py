"""Uniform budgets: every head keeps the same number of entries (SnapKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.budgets.base import Allocator
from criticalkv.state import LayerState


@dataclass(frozen=True)
class Uniform(Allocator):
    """Every KV head of a row keeps ``budget`` entries (Li et al. 2024, SnapKV)."""

    def __call__(self, scores: torch.Tensor, state: LayerState, budget: torch.Tensor) -> torch.Tensor:
        return budget[:, None].expand(-1, state.num_kv_heads).clone()
