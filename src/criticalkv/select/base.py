"""The selection interface."""

from __future__ import annotations

from typing import Protocol

import torch

from criticalkv.state import LayerState


class Selector(Protocol):
    """Chooses the kept entries: returns a (B, H_kv, T) bool mask with exactly ``budgets[b, h]``
    ``True`` per head, the observation window always among them.

    ``scores`` is (B, H_kv, T) with ``-inf`` where an entry cannot be chosen.

    A selection whose order of preference is more than the scores (DefensiveKV's adaptive stage
    1, then attention x value norm) also defines ``rank(scores, state, budget) -> (B, H_kv, T)``
    (``budget``: the (B,) entries per head on average). :meth:`criticalkv.methods.Method.keep_mask`
    then allocates the budgets on that ranking and passes the ranking to the selection in place
    of the scores.
    """

    def __call__(self, scores: torch.Tensor, budgets: torch.Tensor, state: LayerState) -> torch.Tensor: ...
