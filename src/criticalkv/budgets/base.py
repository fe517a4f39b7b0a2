"""The budget-allocation interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from criticalkv.needs import NOTHING, Needs
from criticalkv.state import LayerState


class Allocator(ABC):
    """Splits a layer's budget over its KV heads.

    ``scores`` is (B, H_kv, T) with ``-inf`` on entries that cannot be chosen; ``budget`` is
    (B,) entries per head on average, window included. Returns (B, H_kv) int64 per-head
    budgets (window included) summing to ``H_kv * budget`` per row.
    """

    needs: ClassVar[Needs] = NOTHING

    @abstractmethod
    def __call__(self, scores: torch.Tensor, state: LayerState, budget: torch.Tensor) -> torch.Tensor: ...


class CrossLayerAllocator(Allocator):
    """An allocator over all layers jointly (e.g. :class:`~criticalkv.budgets.LayerJoint`).

    ``joint`` takes every layer's (B, H_kv, T) scores and state and returns, per layer, the
    (B, H_kv) budgets; together they sum to ``L * H_kv * budget`` per row. The caches hand it
    every layer at once (:meth:`criticalkv.methods.Method.keep_masks`). Decode-time compression
    re-selects one layer at a time, each to its share of the decode budget frozen from the prompt's
    joint selection (:mod:`criticalkv.cache.decode.shares`).
    """

    needs: ClassVar[Needs] = Needs(cross_layer=True)

    @abstractmethod
    def joint(
        self, scores: Sequence[torch.Tensor], states: Sequence[LayerState], budget: torch.Tensor
    ) -> list[torch.Tensor]: ...


class HeadScoredAllocator(Allocator):
    """An allocator driven by per-head importance scores (e.g. :class:`~criticalkv.budgets.HeadPrior`).

    :meth:`criticalkv.methods.Method.bind` gives it a model's scores once, before a cache exists.
    """

    needs: ClassVar[Needs] = Needs(head_scores=True)

    @property
    @abstractmethod
    def bound(self) -> bool:
        """Whether head scores are bound."""

    @abstractmethod
    def with_head_scores(self, scores: torch.Tensor | Sequence[Sequence[float]]) -> HeadScoredAllocator:
        """The same allocator bound to ``scores`` (layers, KV heads)."""
