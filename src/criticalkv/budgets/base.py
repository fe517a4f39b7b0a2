"""The budget-allocation interface."""

from __future__ import annotations

from typing import Protocol

import torch

from criticalkv.state import LayerState


class Allocator(Protocol):
    """Splits a layer's budget over its KV heads.

    ``scores`` is (B, H_kv, T) with ``-inf`` on entries that cannot be chosen; ``budget`` is
    (B,) entries per head on average, window included. Returns (B, H_kv) int64 per-head
    budgets (window included) summing to ``H_kv * budget`` per row.
    """

    def __call__(self, scores: torch.Tensor, state: LayerState, budget: torch.Tensor) -> torch.Tensor: ...
