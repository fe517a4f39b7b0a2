"""The score interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from criticalkv.needs import NOTHING, Needs
from criticalkv.state import LayerState


class Scorer(ABC):
    """Maps a layer's prefill state to a (B, H_kv, T) float score per cache entry.

    Higher means more worth keeping. Values on padding and inside the observation window
    are ignored: the method masks them. A scorer that reads more prompt queries than the
    window declares it in ``needs`` (e.g. ``Needs(queries=ALL_QUERIES)``).
    """

    needs: ClassVar[Needs] = NOTHING

    @abstractmethod
    def __call__(self, state: LayerState) -> torch.Tensor: ...
