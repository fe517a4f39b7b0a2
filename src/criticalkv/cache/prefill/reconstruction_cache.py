"""A full cache over a captured prompt that records the attention its entries receive from appended
tokens (KVzip's context reconstruction), then forgets those tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from criticalkv.cache.routing import announce
from criticalkv.scores.kvzip import reconstruction_attention
from criticalkv.state import LayerState


class ReconstructionLayer(DynamicLayer):
    """A dynamic layer holding one captured prompt layer; every forward through it hands its queries
    to :meth:`on_prefill`, which keeps the running maximum of the attention the prompt entries get."""

    def __init__(self, state: LayerState) -> None:
        super().__init__()
        self.layer_idx = state.layer_idx
        self.context = state
        b, t = state.batch_size, state.seq_len
        self.best = torch.zeros(b, state.num_query_heads, t, dtype=torch.float32, device=state.keys.device)
        self.rewind()

    def rewind(self) -> None:
        """Hold the captured prompt again (drop what was appended)."""
        self.keys, self.values = self.context.keys, self.context.values
        self.device, self.dtype, self.is_initialized = self.keys.device, self.keys.dtype, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        announce(self, self.layer_idx)
        return keys, values

    def on_prefill(
        self,
        layer: ReconstructionLayer,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        module: nn.Module,
    ) -> None:
        scaling = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
        seen = reconstruction_attention(query, keys, valid, self.context.seq_len, scaling)
        self.best = torch.maximum(self.best, seen.to(self.best.device))


class ReconstructionCache(Cache):
    """Feed appended tokens after captured prompt states, one pass at a time (:meth:`rewind` between
    passes); :meth:`states` returns the states with :attr:`LayerState.reconstruction` set.

    Needs a model routed through criticalkv (:func:`criticalkv.attach`), like every criticalkv cache.
    """

    def __init__(self, states: Sequence[LayerState]) -> None:
        if not states:
            raise ValueError("no layer states to reconstruct")
        self.captured = list(states)
        self.recording = [ReconstructionLayer(state) for state in self.captured]
        super().__init__(layers=list(self.recording))

    def rewind(self) -> None:
        for layer in self.recording:
            layer.rewind()

    def states(self) -> list[LayerState]:
        """The captured states, each with the most attention its entries received so far."""
        out = []
        for state, layer in zip(self.captured, self.recording, strict=True):
            fields = {**state.__dict__, "memo": {}, "reconstruction": layer.best}
            out.append(LayerState(**fields))
        return out
