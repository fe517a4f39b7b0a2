"""The selection interface."""

from __future__ import annotations

from typing import Protocol

import torch

from criticalkv.state import LayerState


class Selector(Protocol):
    """Chooses the kept entries: returns a (B, H_kv, T) bool mask with exactly ``budgets[b, h]``
    ``True`` per head, the observation window always among them.

    ``scores`` is (B, H_kv, T) with ``-inf`` where an entry cannot be chosen.
    """

    def __call__(self, scores: torch.Tensor, budgets: torch.Tensor, state: LayerState) -> torch.Tensor: ...
