"""One decode step over separate caches at once: continuous batching's forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.rows import RowsCache
from criticalkv.compat import cache_argument
from criticalkv.runtime.forward import input_device


@torch.no_grad()
def decode_rows(model: Any, caches: Sequence[CompressedCache], tokens: Sequence[int]) -> torch.Tensor:
    """Feed ``tokens[r]`` after what ``caches[r]`` holds, for every row in one forward.

    Each cache is a single-row :class:`CompressedCache` holding a compressed prompt (a fork of a
    stored context with its question appended, or a prefilled prompt); rows may differ in length,
    method and budget. The rows' projections run as one batch and each row attends over its own
    cache (:class:`~criticalkv.cache.rows.RowsCache`), so the logits of a row equal those of a
    batch-1 step on its cache alone, whichever rows decode beside it. Each cache's tail grows by
    one token.

    Returns
    -------
    (B, V) logits of the next token of each row.
    """
    if len(caches) != len(tokens):
        raise ValueError(f"{len(caches)} caches but {len(tokens)} tokens: pass one token per cache")
    batch = RowsCache(caches)
    device = input_device(model)
    ids = torch.tensor([[int(t)] for t in tokens], dtype=torch.long, device=device)
    positions = torch.tensor([[n] for n in batch.row_lengths()], dtype=torch.long, device=device)
    out = model(input_ids=ids, position_ids=positions, **cache_argument(model, batch), logits_to_keep=1)
    return out.logits[:, -1]
