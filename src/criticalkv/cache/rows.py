"""Separate compressed caches decoded together, as the rows of one batch.

A server answers many questions at once, each on its own cache: forks of different stored
contexts, of different lengths, each head with its own budget. :class:`RowsCache` puts the
single-row caches side by side for one decode step: the model's projections and MLPs run once
over all rows (the weight reads are shared), while each layer's attention is computed per row
by that row's own :class:`~criticalkv.cache.layer.CompressedLayer` with exactly the arguments
a batch-1 step would pass it. Nothing is copied or padded, so every row decodes exactly as it
would alone, and a row can join or leave between two steps (build a new ``RowsCache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.layer import CompressedLayer
from criticalkv.cache.routing import announce


class RowsLayer(CacheLayerMixin):
    """One decoder layer of several single-row compressed layers (row ``r`` of the batch is ``rows[r]``)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, layer_idx: int, rows: Sequence[CompressedLayer]) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.rows = list(rows)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append row ``r`` of the (B, H_kv, q, d) new entries to ``rows[r]``'s tail."""
        if key_states.shape[0] != len(self.rows):
            raise ValueError(f"this batch has {len(self.rows)} rows but {key_states.shape[0]} were passed")
        for r, layer in enumerate(self.rows):
            layer.append(key_states[r : r + 1], value_states[r : r + 1])
        announce(self, self.layer_idx)
        return key_states, value_states

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of one-token (B, H_q, 1, d) queries, row by row -> (B, 1, H_q, d).

        A single-token step over a batch-1 row needs no mask (no padding, nothing ahead of it),
        which is what a batch-1 decode step passes the layer too.
        """
        return torch.cat([layer.attend(query[r : r + 1], None, scaling) for r, layer in enumerate(self.rows)])

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        length = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.get_seq_length() + length, 0

    def get_seq_length(self) -> int:
        """The longest row's logical length (each row's own positions are passed explicitly)."""
        return max(layer.get_seq_length() for layer in self.rows)

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the name transformers 5.2 uses
        return -1

    def reset(self) -> None:
        raise ValueError("a RowsCache only decodes the caches it joins; reset each row's own cache instead")


class RowsCache(Cache):
    """Single-row :class:`CompressedCache` s joined for one-token decode steps (see the module docstring).

    Parameters
    ----------
    caches : the rows, each a cache of batch size 1 that already holds a compressed prompt.
        Their tails grow as the batch decodes; each stays a valid cache of its own afterwards.
    """

    def __init__(self, caches: Sequence[CompressedCache]) -> None:
        if not caches:
            raise ValueError("a RowsCache needs at least one cache to decode")
        num_layers = caches[0].num_layers
        for i, cache in enumerate(caches):
            if not isinstance(cache, CompressedCache):
                raise TypeError(f"row {i} is a {type(cache).__name__}, not a CompressedCache")
            if cache.num_layers != num_layers:
                raise ValueError(f"row {i} has {cache.num_layers} layers where row 0 has {num_layers}")
            if not cache.holds_prompt() or cache.compressed_layers[0].batch_size != 1:
                raise ValueError(f"row {i} must hold a compressed prompt of exactly one row (prefill it first)")
            if cache.decode is not None:
                raise ValueError(f"row {i} has a decode budget; decode it alone (re-selection is per cache)")
        self.caches = list(caches)
        layers = [RowsLayer(i, [c.compressed_layers[i] for c in caches]) for i in range(num_layers)]
        super().__init__(layers=layers)  # type: ignore[arg-type]

    def row_lengths(self) -> list[int]:
        """Each row's logical length: the position its next token takes."""
        return [cache.get_seq_length() for cache in self.caches]
