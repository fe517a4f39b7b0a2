"""A batch of prompts compressed together, split into single-row caches.

A server compresses the prompts that arrive together in one left-padded prefill (one batch of
``B`` rows), then decodes each answer on a cache of its own beside the others
(:class:`~criticalkv.cache.batch.rows_cache.RowsCache`), where answers join and leave between two steps.
:func:`split_rows` turns the batch into those single-row caches: each holds its row's kept
entries only (a copy; the batch can be dropped), its logical length is its own prompt's (the
padding columns dropped), so its next token takes the position it would have alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.tokens import TokenRecord


def split_rows(cache: CompressedCache, lengths: Sequence[int]) -> list[CompressedCache]:
    """The rows of ``cache`` as single-row caches; ``lengths[r]``: row ``r``'s prompt tokens.

    ``cache`` holds a compressed, left-padded batch of prompts and nothing appended yet (split
    right after the prefill). Raises ``ValueError`` if the lengths do not describe its rows, or a
    row kept an entry of its padding.
    """
    layers = cache.compressed_layers
    if not cache.holds_prompt():
        raise ValueError("the cache holds no compressed prompt to split")
    rows, width = layers[0].batch_size, layers[0].prefix_len
    if len(lengths) != rows:
        raise ValueError(f"the cache holds {rows} rows but {len(lengths)} lengths were passed")
    if any(not 1 <= n <= width for n in lengths):
        raise ValueError(f"row lengths must be in [1, {width}] (the padded prompt), not {list(lengths)}")
    if any(layer.tail_len for layer in layers):
        raise ValueError("split the batch before anything is appended to it")
    return [_row(cache, r, int(n), width) for r, n in enumerate(lengths)]


def _row(cache: CompressedCache, r: int, length: int, width: int) -> CompressedCache:
    """Row ``r`` (``length`` real tokens after ``width - length`` padding columns) on its own."""
    pad = width - length
    row = cache.fork()
    row.batch_select_indices(torch.tensor([r]))
    for layer in row.compressed_layers:
        keep = layer.keep
        if keep is not None:
            if bool(keep[:, :, :pad].any()):
                raise ValueError(f"row {r} kept entries of its padding; its length {length} is wrong")
            keep = keep[:, :, pad:]
        layer.restore_shape(layer.geometry(), keep, length, False)
    for name in ("real_prompt_tokens", "budget_tokens"):
        value = getattr(cache, name)
        setattr(row, name, None if value is None else value[r : r + 1])
    ids = row.tokens.ids()
    row.tokens = TokenRecord(None if ids is None else [ids[:, pad:]])
    return row
