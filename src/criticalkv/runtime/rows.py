"""One decode step over separate caches at once: continuous batching's forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from criticalkv.cache.batch import RowsCache
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.compat import cache_argument
from criticalkv.runtime.forward import input_device


@torch.no_grad()
def decode_rows(model: Any, caches: Sequence[CompressedCache], tokens: Sequence[int]) -> torch.Tensor:
    """Feed ``tokens[r]`` after what ``caches[r]`` holds, for every row in one forward.

    Each cache is a single-row :class:`CompressedCache` holding a compressed prompt (a fork of a
    stored context with its question appended, or a prefilled prompt); rows may differ in length,
    method and budget. The rows' projections run as one batch and each row attends over its own
    cache (:class:`~criticalkv.cache.batch.rows_cache.RowsCache`), so the logits of a row equal those of a
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


@torch.no_grad()
def append_rows(model: Any, caches: Sequence[CompressedCache], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
    """Feed ``tokens[r]`` (one or more ids) after what ``caches[r]`` holds, for every row in one forward.

    The batched start of continuous batching: the questions of answers that begin together, each
    on its own cache (a fork of its stored context), right-padded to the longest and run as the
    rows of one forward. Only a row's real tokens enter its cache, at the positions that follow
    its own length, and its attention is causal over them on its own cache
    (:class:`~criticalkv.cache.batch.rows_cache.RowsCache`), so a row's logits equal those of a batch-1
    :func:`~criticalkv.runtime.append_tokens` on its cache alone. Each tail grows by ``len(tokens[r])``.

    Returns
    -------
    (B, V) logits that follow the last token of each row (its answer's first token).
    """
    if len(caches) != len(tokens):
        raise ValueError(f"{len(caches)} caches but {len(tokens)} token lists: pass one list per cache")
    lengths = [len(row) for row in tokens]
    if min(lengths, default=1) < 1:
        raise ValueError("every row needs at least one token to append")
    batch = RowsCache(caches, lengths)
    device = input_device(model)
    width = max(lengths)
    ids = torch.zeros(len(caches), width, dtype=torch.long, device=device)  # padding: never enters a cache
    for r, row in enumerate(tokens):
        ids[r, : len(row)] = torch.tensor([int(t) for t in row], dtype=torch.long)
    starts = torch.tensor(batch.row_lengths(), dtype=torch.long, device=device)
    positions = starts[:, None] + torch.arange(width, device=device)[None, :]
    last = sorted(set(n - 1 for n in lengths))  # the lm head runs on these positions only
    keep = torch.tensor(last, dtype=torch.long, device=device)
    out = model(input_ids=ids, position_ids=positions, **cache_argument(model, batch), logits_to_keep=keep)
    column = torch.tensor([last.index(n - 1) for n in lengths], device=device)
    return out.logits[torch.arange(len(caches), device=device), column]
