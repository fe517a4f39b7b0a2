"""The score interface."""

from __future__ import annotations

from typing import Protocol

import torch

from criticalkv.state import LayerState


class Scorer(Protocol):
    """Maps a layer's prefill state to a (B, H_kv, T) float score per cache entry.

    Higher means more worth keeping. Values on padding and inside the observation window
    are ignored: the method masks them.
    """

    def __call__(self, state: LayerState) -> torch.Tensor: ...
