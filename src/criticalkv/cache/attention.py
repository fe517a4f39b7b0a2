"""The ``criticalkv`` attention implementation and :func:`attach`.

Registered under a new name in transformers' attention registry (no existing
implementation is patched). It behaves exactly like ``sdpa`` unless the layer's cache is a
criticalkv cache: then the prefill runs with full attention and hands the layer's state to
the cache for compression, and decoding attends over the compressed, ragged cache.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from criticalkv.cache.batch import RowsLayer
from criticalkv.cache.continuation import guard_reuse
from criticalkv.cache.layer import CompressedLayer
from criticalkv.cache.routing import claim

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "criticalkv"


def _valid_from_mask(
    attention_mask: torch.Tensor | None, batch: int, length: int, device: torch.device
) -> torch.Tensor:
    """(B, T) bool of real tokens, read off the diagonal of the prefill's 4D mask (or, for tokens
    appended after cached ones, off its last row: the last query sees every real key)."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if attention_mask.shape[-2] < length:
        diagonal = attention_mask[:, 0, -1, -length:]
    else:
        diagonal = torch.diagonal(attention_mask[:, 0, -length:, -length:], dim1=-2, dim2=-1)
    if diagonal.dtype != torch.bool:
        diagonal = diagonal == 0
    return diagonal.expand(batch, length).to(device)  # the layer's device when sharded


def criticalkv_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function with the signature of transformers' ``sdpa_attention_forward`` (see module
    docstring); the argument order matters to wrappers that pass ``dropout`` positionally."""
    layer = claim()
    if layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    if isinstance(layer, RowsLayer):  # separate caches decoded as one batch (cache/batch/rows_cache.py)
        return layer.attend(query, scale), None
    if isinstance(layer, CompressedLayer) and layer.holds_prompt:
        out = layer.attend(query, attention_mask, scale)
        if layer.on_attend is not None:  # the cache may re-select now that this step attended
            with torch.no_grad():
                layer.on_attend(layer, query, value, attention_mask, module)
        return out, None
    out, _ = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    valid = _valid_from_mask(attention_mask, key.shape[0], key.shape[2], key.device)
    with torch.no_grad():
        layer.on_prefill(layer, query, key, value, valid, module)
    return out, None


AttentionInterface.register(ATTN_IMPLEMENTATION, criticalkv_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def route_attention(model: nn.Module) -> nn.Module:
    """Route ``model``'s attention through criticalkv (idempotent; returns the model).

    Without a criticalkv cache the model computes exactly what ``sdpa`` computes, so a routed
    model can still be used normally. A compressed cache that holds a prompt is guarded against
    reuse for another one (:mod:`criticalkv.cache.continuation`). :func:`criticalkv.attach`
    checks the architecture first.
    """
    guard_reuse(model)
    config: Any = model.config
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        setter = getattr(model, "set_attn_implementation", None)
        if callable(setter):
            setter(ATTN_IMPLEMENTATION)
        else:
            config._attn_implementation = ATTN_IMPLEMENTATION
        logger.debug("attached criticalkv attention to %s", type(model).__name__)
    return model
