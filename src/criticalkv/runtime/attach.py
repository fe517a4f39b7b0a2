"""Preparing a model for criticalkv: an architecture check, then attention routed through the cache."""

from __future__ import annotations

from torch import nn

from criticalkv.cache.attention import route_attention
from criticalkv.models import check_supported


def attach(model: nn.Module) -> nn.Module:
    """Check that criticalkv supports ``model`` and route its attention through criticalkv
    (idempotent; returns the model).

    Without a criticalkv cache the model computes exactly what ``sdpa`` computes, so an
    attached model can still be used normally.

    Raises
    ------
    ValueError
        If the architecture is not supported (the message says why).
    """
    check_supported(model)
    return route_attention(model)
