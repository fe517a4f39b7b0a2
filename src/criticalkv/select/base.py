"""The selection interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from criticalkv.needs import NOTHING, Needs
from criticalkv.state import LayerState


class Selector(ABC):
    """Chooses the kept entries: returns a (B, H_kv, T) bool mask with exactly ``budgets[b, h]``
    ``True`` per head, the observation window always among them.

    ``scores`` is (B, H_kv, T) with ``-inf`` where an entry cannot be chosen.

    ``top_ranked``: the selection keeps each head's ``budgets - window`` highest ``scores`` and the
    window, nothing else (top-k, DefensiveKV's ranking). A cross-layer cache then holds, during the
    prefill, only the entries that can still be among them (:mod:`criticalkv.cache.prefill.joint`).
    """

    needs: ClassVar[Needs] = NOTHING
    top_ranked: ClassVar[bool] = False

    @abstractmethod
    def __call__(self, scores: torch.Tensor, budgets: torch.Tensor, state: LayerState) -> torch.Tensor: ...


class RankingSelector(Selector):
    """A selection whose order of preference is more than the scores (DefensiveKV's adaptive stage
    1, then attention x value norm).

    ``rank(scores, state, budget)`` returns the (B, H_kv, T) ranking (``budget``: the (B,) entries
    per head on average); :meth:`criticalkv.methods.Method.keep_mask` allocates the budgets on that
    ranking and passes it to the selection in place of the scores.
    """

    needs: ClassVar[Needs] = Needs(ranks=True, value_norms=True)

    @abstractmethod
    def rank(self, scores: torch.Tensor, state: LayerState, budget: torch.Tensor) -> torch.Tensor: ...
