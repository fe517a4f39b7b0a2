"""Synthetic head importance scores for the tiny random test models (no scoring run needed)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import torch

from criticalkv.budgets import HeadScoredAllocator
from criticalkv.headscores import HeadScores, architecture
from criticalkv.methods import Method
from criticalkv.state import LayerState


def synthetic_head_scores(model: Any, seed: int = 0) -> HeadScores:
    """Skewed random (layers, KV heads) scores for ``model`` (or its config)."""
    config = getattr(model, "config", model)
    arch = architecture(config)
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(arch["num_hidden_layers"], arch["num_key_value_heads"], generator=g) ** 3 + 0.01
    return HeadScores.from_matrix(scores, config, model="synthetic", variant="synthetic")


def bind_synthetic(method: Method, state: LayerState, seed: int = 0) -> Method:
    """``method`` with head-prior budgets bound to random scores of ``state``'s shape (no model)."""
    if not method.needs.head_scores:
        return method
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(state.num_layers, state.num_kv_heads, generator=g) ** 3 + 0.01
    budgets = cast(HeadScoredAllocator, method.budgets).with_head_scores(scores)
    return replace(method, budgets=budgets)
