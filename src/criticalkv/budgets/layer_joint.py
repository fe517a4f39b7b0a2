"""Layer-DefensiveKV's budgets: one selection across every layer and head of the model (Feng et al.
2025, "Taming the Fragility of KV Cache Eviction in LLM Inference", arXiv 2510.13334)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from criticalkv.budgets.base import CrossLayerAllocator
from criticalkv.select.topk import topk_mask
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerJoint(CrossLayerAllocator):
    """Per-(layer, head) budgets from the model's globally highest scores, same total as uniform.

    AdaKV pools the budget of a layer's heads; this pools the whole model's: a row keeps its
    ``L * H_kv * (b - w)`` highest-scoring entries outside the windows, wherever they are, plus
    every head's window. So a layer keeps as many entries as its scores earn, every head keeps at
    least its window and at most its row's tokens, and the model keeps exactly ``L * H_kv * b``
    entries per row (per-layer totals vary). With DefensiveKV's selection the scores are its
    ranking, so every head's stage-1 entries come first, in every layer.

    The released code (``EfficientAdaGlobalScorerPress``) has no floor: each layer's window and
    stage-1 entries rank at that layer's highest score, so a layer whose scores are low everywhere
    can lose them, window included, to other layers. Here the window is kept by construction and
    stage-1 entries rank above every stage-2 score of any layer.

    ``cross_layer`` marks the allocator for the caches: they hold every layer's prefill state
    until the last layer has been seen, then select jointly (:meth:`joint`), so the full prompt
    cache of every layer is held until the end of the prefill (the per-layer methods free each
    layer's as soon as it is compressed). Called on one layer alone (the :class:`Allocator`
    interface) it is the joint selection over that layer: AdaKV-style pooling over its heads
    without a safeguard.
    """

    def __call__(self, scores: torch.Tensor, state: LayerState, budget: torch.Tensor) -> torch.Tensor:
        return self.joint([scores], [state], budget)[0]

    def joint(
        self, scores: Sequence[torch.Tensor], states: Sequence[LayerState], budget: torch.Tensor
    ) -> list[torch.Tensor]:
        """Per layer, (B, H_kv) int64 budgets (window included) from one top-k over all layers.

        ``scores[l]`` is layer ``l``'s (B, H_kv, T), ``-inf`` where an entry cannot be chosen;
        ``budget`` the (B,) entries per head on average over the model, window included.
        """
        if not states or len(scores) != len(states):
            raise ValueError(f"joint budgets need one score tensor per layer state ({len(scores)} vs {len(states)})")
        first = states[0]
        for state in states[1:]:
            if state.window != first.window or not torch.equal(state.valid, first.valid):
                raise ValueError("joint budgets need the states of one prompt (same tokens, padding and window)")
        w = first.window
        device = scores[0].device
        stacked = torch.stack([s.to(device) for s in scores], dim=1)  # (B, L, H_kv, T)
        eligible = torch.stack([s.eligible.to(device) for s in states], dim=1)
        b, n_layers, h, t = stacked.shape
        selectable = n_layers * h * (budget.to(device).long() - w)
        chosen = topk_mask(stacked.reshape(b, -1), selectable, eligible.reshape(b, -1)).view(b, n_layers, h, t)
        per_head = w + chosen.sum(-1)
        logger.debug("joint budgets over %d layers: per-layer entries %s", n_layers, per_head.sum(-1).tolist())
        return list(per_head.unbind(dim=1))
