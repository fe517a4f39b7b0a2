"""Knorm: keep the keys with the lowest L2 norm (Devoto et al. 2024, arXiv 2406.11430)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.scores.base import Scorer
from criticalkv.state import LayerState


@dataclass(frozen=True)
class KeyNorm(Scorer):
    """Score ``-||k_i||_2`` of each key (after RoPE), per KV head.

    Devoto et al. observe that keys with a low L2 norm draw high attention, so a cache that
    keeps the lowest-norm keys needs no attention scores at all.
    """

    def __call__(self, state: LayerState) -> torch.Tensor:
        return -torch.linalg.vector_norm(state.keys.float(), dim=-1)
