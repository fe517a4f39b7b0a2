"""What the answers being decoded hold in memory, and the most they may come to hold.

A row on a stored context shares that context's compressed prefix (counted once however many
rows read it) and holds a tail of its own: its question and the tokens it generates. The
engine admits an answer only if its context and its tail's reserve fit in the memory cap
beside every running row's context and reserve, so the bytes the rows hold stay within the cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from criticalkv.cache.layer import MIN_GROWTH


def token_bytes(model: Any) -> int:
    """KV bytes one appended token takes in a single-row cache of ``model`` (every layer)."""
    config = model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    element = torch.finfo(model.dtype).bits // 8
    return int(config.num_hidden_layers) * 2 * kv_heads * head_dim * element


def tail_reserve(per_token: int, tokens: int) -> int:
    """The most bytes a fork's tail holds for ``tokens`` appended entries (its capacity grows to
    ``need + max(MIN_GROWTH, need // 8)``, :class:`~criticalkv.cache.layer.CompressedLayer`)."""
    return per_token * (tokens + max(MIN_GROWTH, tokens // 8))


def held_bytes(rows: Sequence[Any], reserved: bool = False) -> int:
    """KV bytes ``rows`` (serve sessions) hold: each stored context they read once, plus every
    row's own (its fork's tail, or its whole cache for a prompt compressed for the request);
    with ``reserved``, the most each row may come to hold of its own."""
    contexts: dict[str, int] = {}
    own = 0
    for session in rows:
        if session.cache is None:
            continue
        if session.work.context_id is not None:
            contexts[session.work.context_id] = session.context_bytes
        own += max(session.own_bytes(), session.reserve) if reserved else session.own_bytes()
    return own + sum(contexts.values())
