"""Separate compressed caches decoded together, as the rows of one batch.

A server answers many questions at once, each on its own cache: forks of different stored
contexts, of different lengths, each head with its own budget. :class:`RowsCache` puts the
single-row caches side by side for one forward: the model's projections and MLPs run once
over all rows (the weight reads are shared), while each layer's attention is computed per row
by that row's own :class:`~criticalkv.cache.layer.CompressedLayer` with exactly the arguments
a batch-1 step would pass it. Nothing of a cache is copied or padded, so every row decodes
exactly as it would alone, and a row can join or leave between two steps (build a new
``RowsCache``).

A forward may also append several tokens per row (the questions of answers that start
together): row ``r`` gets ``lengths[r]`` real tokens, right-padded to the longest; only the
real ones enter its cache and its attention is causal over them, as a batch-1 append's is.
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

    def __init__(self, layer_idx: int, rows: Sequence[CompressedLayer], lengths: Sequence[int]) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.rows = list(rows)
        self.lengths = list(lengths)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the first ``lengths[r]`` of row ``r``'s (B, H_kv, q, d) new entries (the rest is
        padding) to ``rows[r]``'s tail."""
        if key_states.shape[0] != len(self.rows):
            raise ValueError(f"this batch has {len(self.rows)} rows but {key_states.shape[0]} were passed")
        if key_states.shape[2] != max(self.lengths):
            raise ValueError(f"the rows append up to {max(self.lengths)} tokens but {key_states.shape[2]} were passed")
        for r, (layer, n) in enumerate(zip(self.rows, self.lengths, strict=True)):
            layer.append(key_states[r : r + 1, :, :n], value_states[r : r + 1, :, :n])
        announce(self, self.layer_idx)
        return key_states, value_states

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of (B, H_q, q, d) queries, row by row -> (B, q, H_q, d).

        Row ``r``'s first ``lengths[r]`` queries attend over its own cache, causally among its
        appended tokens (the layer builds that mask itself when given none, the same one a
        batch-1 append's mask holds); a single-token step needs no mask at all, as in a batch-1
        decode step. The outputs at padded positions are zeros (nothing reads them).
        """
        q = query.shape[2]
        if q == 1:
            return torch.cat([layer.attend(query[r : r + 1], None, scaling) for r, layer in enumerate(self.rows)])
        out = query.new_zeros(query.shape[0], q, query.shape[1], query.shape[3])
        for r, (layer, n) in enumerate(zip(self.rows, self.lengths, strict=True)):
            out[r : r + 1, :n] = layer.attend(query[r : r + 1, :, :n], None, scaling)
        return out

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
    """Single-row :class:`CompressedCache` s joined for one forward (see the module docstring).

    Parameters
    ----------
    caches : the rows, each a cache of batch size 1 that already holds a compressed prompt.
        Their tails grow as the batch decodes; each stays a valid cache of its own afterwards.
    lengths : the real tokens each row appends in this forward (default: one each, a decode step).
    """

    def __init__(self, caches: Sequence[CompressedCache], lengths: Sequence[int] | None = None) -> None:
        if not caches:
            raise ValueError("a RowsCache needs at least one cache to decode")
        lengths = [1] * len(caches) if lengths is None else [int(n) for n in lengths]
        if len(lengths) != len(caches) or min(lengths) < 1:
            raise ValueError(f"pass one length of at least 1 per cache, not {lengths} for {len(caches)} caches")
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
        self.lengths = lengths
        layers = [RowsLayer(i, [c.compressed_layers[i] for c in caches], lengths) for i in range(num_layers)]
        super().__init__(layers=layers)  # type: ignore[arg-type]

    def row_lengths(self) -> list[int]:
        """Each row's logical length: the position its next appended token takes."""
        return [cache.get_seq_length() for cache in self.caches]
