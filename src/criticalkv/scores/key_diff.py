"""KeyDiff's score: key dissimilarity to the mean key (Park et al. 2025, "KeyDiff: Key Similarity-Based
KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments", arXiv 2504.15364)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from criticalkv.scores.base import Scorer
from criticalkv.state import LayerState


@dataclass(frozen=True)
class KeyDissimilarity(Scorer):
    """Score ``-cos(k_i, a)`` with the anchor ``a`` the mean of the row's normalised keys, per KV head.

    KeyDiff observes that keys far from the others in direction draw attention from diverse
    queries, so it keeps the most distinctive keys and needs no attention scores (it works with
    any attention kernel). The anchor is the mean of the unit keys (after RoPE) over the row's
    real tokens, the observation window included; padding is left out, so a left-padded row
    scores as it would alone.
    """

    def __call__(self, state: LayerState) -> torch.Tensor:
        unit = F.normalize(state.keys.float(), p=2, dim=-1)  # (B, H_kv, T, d)
        real = state.valid[:, None, :, None].to(unit.dtype)
        anchor = (unit * real).sum(dim=2, keepdim=True) / real.sum(dim=2, keepdim=True).clamp_min(1.0)
        return -F.cosine_similarity(unit, anchor, dim=-1)
