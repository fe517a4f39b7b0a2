"""What the answers being decoded hold in memory, and the most they may come to hold.

A row on a stored context shares that context's compressed prefix (counted once however many
rows read it) and holds a tail of its own: its question and the tokens it generates. The
engine admits an answer only if its context and its tail's reserve fit in the memory cap
beside every running row's context and reserve, so the bytes the rows hold stay within the cap.
With quantized storage a tail holds a full-precision residual and quantized blocks
(:class:`~criticalkv.cache.quantized.layer.QuantizedLayer`); its reserve bounds both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from criticalkv.cache.layer import MIN_GROWTH
from criticalkv.cache.quantized import DEFAULT_RESIDUAL, KVQuantization, empty_blocks


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


def tail_reserve(per_token: int, tokens: int) -> int:
    """The most bytes a fork's tail holds for ``tokens`` appended entries (its capacity grows to
    ``need + max(MIN_GROWTH, need // 8)``, :class:`~criticalkv.cache.layer.CompressedLayer`)."""
    return per_token * (tokens + max(MIN_GROWTH, tokens // 8))


def quantized_tail_reserve(model: Any, spec: KVQuantization, first: int, tokens: int) -> int:
    """The most bytes a quantized single-row tail holds for ``tokens`` appended entries, the
    first append ``first`` of them (a question) and then one at a time.

    The residual grows to ``need + G`` when full and keeps at most ``residual + G`` entries after
    an append of one, so its capacity stays within ``max(first + G, min(tokens, residual + G) + G)``;
    the quantized blocks (at most ``tokens // G``) grow to ``need + max(2, need // 8)``.
    """
    layers, kv_heads, head_dim = _shape(model)
    g = spec.group_size
    residual = DEFAULT_RESIDUAL if spec.residual is None else spec.residual  # the default is capped below it
    capacity = max(first + g, min(tokens, residual + g) + g)
    blocks = tokens // g
    block_capacity = blocks + max(2, blocks // 8) if blocks else 0
    block = empty_blocks(1, 1, head_dim, spec.bits, g, torch.device("cpu")).nbytes()
    element = torch.finfo(model.dtype).bits // 8
    return layers * kv_heads * (capacity * 2 * head_dim * element + block_capacity * block)


def answer_reserve(model: Any, spec: KVQuantization | None, work: Any, per_token: int) -> int:
    """The most KV bytes of its own an answer (a serve ``ChatWork``) may hold: a fork's tail (its
    question and answer), or a prompt compressed for the request (bounded by the whole prompt at
    full precision) and its answer's tail."""
    on_context = work.context_id is not None
    prompt, answer = len(work.prompt_ids), work.max_tokens
    if spec is None:
        return tail_reserve(per_token, prompt + answer)
    if on_context:
        return quantized_tail_reserve(model, spec, prompt, prompt + answer)
    return per_token * prompt + quantized_tail_reserve(model, spec, 1, answer)


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
