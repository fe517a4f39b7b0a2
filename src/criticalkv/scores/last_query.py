"""TOVA's score: the last query's attention (Oren et al. 2024, "Transformers are Multi-State RNNs",
arXiv 2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from criticalkv.scores.base import Scorer
from criticalkv.state import LayerState


@dataclass(frozen=True)
class LastQueryAttention(Scorer):
    """Attention of the prompt's last query over every key, averaged over query heads.

    TOVA (Token Omission Via Attention) keeps the entries the most recent token attends to most:
    the last query of each query head is softmaxed over the row's real keys (float32), and the
    weights are averaged over the heads. TOVA averages over *all* heads of the layer, so every
    head keeps the same entries (the paper's layer-wise policy, as kvpress's ``TOVAPress``);
    ``heads="group"`` averages over the query heads of each KV group instead, so KV heads differ.

    Parameters
    ----------
    heads : "all" (TOVA, kvpress) or "group" (a per-KV-head variant).
    """

    heads: Literal["all", "group"] = "all"

    def __post_init__(self) -> None:
        if self.heads not in ("all", "group"):
            raise ValueError(f"heads must be 'all' or 'group', not {self.heads!r}")

    def __call__(self, state: LayerState) -> torch.Tensor:
        return state.remember(("last_query", self.heads), lambda: self._scores(state))

    def _scores(self, state: LayerState) -> torch.Tensor:
        b, h_kv, t, d = state.keys.shape
        g = state.group_size
        last = state.queries[:, :, -1, :].reshape(b, h_kv, g, d)
        logits = torch.matmul(last, state.keys.transpose(-1, -2)).float() * state.scaling  # (B, H_kv, G, T)
        logits = logits.masked_fill(~state.valid[:, None, None, :], float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        if self.heads == "group":
            return weights.mean(dim=2)
        return weights.mean(dim=(1, 2))[:, None, :].expand(b, h_kv, t).contiguous()
