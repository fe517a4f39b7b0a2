"""A full cache that also records each layer's prefill state, to compress it many ways later."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from criticalkv.cache.prefill.state_builder import DEFAULT_WINDOW, check_window, state_from_prefill
from criticalkv.cache.routing import announce
from criticalkv.needs import QueriesNeeded, check_queries_needed
from criticalkv.scores.queries import resolve_num_queries
from criticalkv.state import LayerState


class CaptureLayer(DynamicLayer):
    """A dynamic (full) layer that hands its prefill to the attention function once."""

    def __init__(self, layer_idx: int, owner: CaptureCache) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner
        self.state: LayerState | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.state is None and self.get_seq_length() == 0
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if first:
            announce(self, self.layer_idx)
        return keys, values

    def on_prefill(
        self,
        layer: CaptureLayer,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        module: nn.Module,
    ) -> None:
        self.state = state_from_prefill(
            query,
            keys,
            values,
            valid,
            module,
            window=self.owner.window,
            layer_idx=self.layer_idx,
            num_layers=self.owner.num_layers,
            num_queries=resolve_num_queries(self.owner.num_queries, query.shape[2]),
        )


class CaptureCache(Cache):
    """Run the prefill once with this cache, then build any number of compressed caches
    from :meth:`states` with :meth:`CompressedCache.from_states` (no second prefill).

    Parameters
    ----------
    num_layers : decoder layers of the model.
    window : observation window recorded (its queries are kept).
    num_queries : keep this many last queries instead, or ``'all'`` (for scores that need more
        than the window, such as H2O's: see ``criticalkv.scores.queries``).
    """

    def __init__(self, num_layers: int, window: int = DEFAULT_WINDOW, num_queries: QueriesNeeded = None) -> None:
        self.window = check_window(window)
        self.num_layers = num_layers
        self.num_queries = check_queries_needed(num_queries)
        layers = [CaptureLayer(i, self) for i in range(num_layers)]
        super().__init__(layers=layers)  # type: ignore[arg-type]

    def states(self) -> list[LayerState]:
        """The recorded prefill state of every layer."""
        out = []
        for layer in self.layers:
            state = layer.state  # type: ignore[union-attr]
            if state is None:
                raise ValueError("run a prefill forward pass with this cache before asking for its states")
            out.append(state)
        return out
