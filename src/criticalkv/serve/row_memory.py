"""What the answers being decoded hold in memory, and the most they may come to hold.

A row on a stored context shares that context's compressed prefix (counted once however many
rows read it) and holds a tail of its own: its question and the tokens it generates. The
engine admits an answer only if its context and its tail's reserve fit in the memory cap
beside every running row's context and reserve, so the bytes the rows hold stay within the cap.
A row's reserve is what the storage it uses says its tail may come to hold
(:meth:`~criticalkv.cache.storage.Storage.tail_bytes`, the storage's own growth policy; with
quantized storage a full-precision residual and quantized blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from criticalkv.cache import Geometry, storage_class
from criticalkv.cache.quantized import KVQuantization


def _shape(model: Any) -> tuple[int, int, int]:
    """(decoder layers, KV heads, head dimension) of ``model``."""
    config = model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return int(config.num_hidden_layers), kv_heads, head_dim


def token_bytes(model: Any) -> int:
    """KV bytes one appended token takes in a single-row cache of ``model`` (every layer)."""
    layers, kv_heads, head_dim = _shape(model)
    return layers * 2 * kv_heads * head_dim * (torch.finfo(model.dtype).bits // 8)


def _row_geometry(model: Any) -> tuple[int, Geometry]:
    """(decoder layers, the geometry of one single-row layer) of ``model``."""
    layers, kv_heads, head_dim = _shape(model)
    return layers, Geometry(1, kv_heads, head_dim, model.dtype, torch.device("cpu"))


def answer_reserve(model: Any, storage: KVQuantization | None, work: Any, per_token: int) -> int:
    """The most KV bytes of its own an answer (a serve ``ChatWork``) may hold, as ``storage`` (its
    spec's: ``None`` unquantized) computes it (:meth:`~criticalkv.cache.storage.Storage.tail_bytes`): a fork's tail (its
    question, appended at once, and its answer), or a prompt compressed for the request (bounded by
    the whole prompt at full precision) and its answer's tail."""
    layers, geometry = _row_geometry(model)
    kind = storage_class(storage)
    prompt, answer = len(work.prompt_ids), work.max_tokens
    if work.context_id is not None:
        return layers * kind.tail_bytes(storage, geometry, prompt, prompt + answer)
    return per_token * prompt + layers * kind.tail_bytes(storage, geometry, 1, answer)


def held_bytes(rows: Sequence[Any], reserved: bool = False) -> int:
    """KV bytes ``rows`` (serve sessions) hold: each stored context they read once, plus every
    row's own (its fork's tail, or its whole cache for a prompt compressed for the request);
    with ``reserved``, the most each row may come to hold of its own."""
    contexts: dict[str, int] = {}
    own = 0
    for session in rows:
        if not session.holds_memory():
            continue
        if session.work.context_id is not None:
            contexts[session.work.context_id] = session.context_bytes
        own += max(session.own_bytes(), session.reserve) if reserved else session.own_bytes()
    return own + sum(contexts.values())
