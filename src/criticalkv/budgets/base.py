"""The budget-allocation interface."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

import torch

from criticalkv.state import LayerState


class Allocator(Protocol):
    """Splits a layer's budget over its KV heads.

    ``scores`` is (B, H_kv, T) with ``-inf`` on entries that cannot be chosen; ``budget`` is
    (B,) entries per head on average, window included. Returns (B, H_kv) int64 per-head
    budgets (window included) summing to ``H_kv * budget`` per row.

    An allocator that splits the budget across layers as well declares ``cross_layer = True``
    and a ``joint(scores, states, budget)`` method (see :class:`CrossLayerAllocator`); the
    caches then hand it every layer at once (:meth:`criticalkv.methods.Method.keep_masks`).
    """

    def __call__(self, scores: torch.Tensor, state: LayerState, budget: torch.Tensor) -> torch.Tensor: ...


class CrossLayerAllocator(Allocator, Protocol):
    """An allocator over all layers jointly (e.g. :class:`~criticalkv.budgets.LayerJoint`).

    ``joint`` takes every layer's (B, H_kv, T) scores and state and returns, per layer, the
    (B, H_kv) budgets; together they sum to ``L * H_kv * budget`` per row.
    """

    cross_layer: ClassVar[bool]

    def joint(
        self, scores: Sequence[torch.Tensor], states: Sequence[LayerState], budget: torch.Tensor
    ) -> list[torch.Tensor]: ...
