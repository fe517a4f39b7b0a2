"""Recording every layer's queries (after RoPE) during a forward pass.

The analysis needs the decode queries of teacher-forced answer tokens. They are read where the
model hands them to its attention function: a probe implementation, registered under its own
name in transformers' attention registry (nothing is patched), records them and then runs the
``criticalkv`` attention function unchanged. :func:`recording_queries` switches a model to the
probe for the duration of a ``with`` block and always switches it back.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from criticalkv.cache.attention import criticalkv_attention
from criticalkv.runtime.attach import attach

PROBE_IMPLEMENTATION = "criticalkv_probe"


class QueryRecord:
    """The queries each layer received, in call order."""

    def __init__(self) -> None:
        self._queries: dict[int, list[torch.Tensor]] = {}

    def add(self, layer_idx: int, query: torch.Tensor) -> None:
        self._queries.setdefault(layer_idx, []).append(query.detach())

    def layer(self, layer_idx: int) -> torch.Tensor:
        """(B, H_q, n, d): every query layer ``layer_idx`` received, concatenated over calls."""
        if layer_idx not in self._queries:
            raise ValueError(f"no queries were recorded for layer {layer_idx}; run a forward pass inside the block")
        return torch.cat(self._queries[layer_idx], dim=2)

    def layers(self, num_layers: int) -> list[torch.Tensor]:
        """:meth:`layer` for layers ``0 .. num_layers - 1``."""
        return [self.layer(i) for i in range(num_layers)]


_RECORD: contextvars.ContextVar[QueryRecord | None] = contextvars.ContextVar("criticalkv_query_record", default=None)


def probe_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The ``criticalkv`` attention function, recording ``query`` (B, H_q, q, d) first."""
    record = _RECORD.get()
    if record is not None:
        record.add(int(getattr(module, "layer_idx", -1)), query)
    return criticalkv_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(PROBE_IMPLEMENTATION, probe_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE_IMPLEMENTATION, sdpa_mask)


def _set_implementation(model: Any, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:
        model.config._attn_implementation = name


@contextmanager
def recording_queries(model: Any) -> Iterator[QueryRecord]:
    """Record the queries of every forward pass of ``model`` inside the block.

    The model is attached to criticalkv (:func:`criticalkv.attach`) and computes exactly what it
    computes without the block; its attention implementation is restored on exit.

    Yields
    ------
    :class:`QueryRecord`, filled as the forward passes run.
    """
    attach(model)
    previous = model.config._attn_implementation
    _set_implementation(model, PROBE_IMPLEMENTATION)
    record = QueryRecord()
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)
        _set_implementation(model, previous)
