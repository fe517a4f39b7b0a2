"""Several compressions of one prompt as the rows of one cache, to decode them in one batch.

A sweep compares many (method, budget) pairs on the same prefill. Stacking them as batch rows
shares every weight read of the decode steps (the bulk of decode time on a small model) while
each row still holds only its own kept entries.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from criticalkv.budgets.resolve import Budget, resolve_budget
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.decode import DecodeCompression
from criticalkv.cache.quantized import KVQuantization
from criticalkv.cache.spec import CacheSpec, DecodeBudget
from criticalkv.methods import Method, get_method
from criticalkv.state import LayerState


def keep_masks(
    states: Sequence[LayerState], method: Method, budget: Budget, at_most: int | None = None
) -> list[torch.Tensor]:
    """Per layer, the (B, H_kv, T) keep mask ``method`` chooses at ``budget`` (jointly over the
    layers for cross-layer budgets, see :meth:`Method.keep_masks`), at most ``at_most`` entries per
    KV head on average (a decode budget)."""
    tokens = resolve_budget(budget, states[0].lengths, states[0].window)
    return method.keep_masks(states, tokens if at_most is None else tokens.clamp(max=at_most))


def stacked_cache(
    states: Sequence[LayerState],
    configs: Sequence[tuple[Method, Budget]],
    at_most: int | None = None,
    storage: KVQuantization | None = None,
) -> tuple[CompressedCache, list[float]]:
    """One cache whose row ``i`` is the single-row prompt of ``states`` compressed by ``configs[i]``,
    stored as ``storage`` says (``None``: the model's dtype).

    ``at_most`` caps every config's entries per KV head on average (a decode budget). Returns the
    cache and the selection time of each config (seconds).
    """
    if not states or states[0].batch_size != 1:
        raise ValueError("stacking needs the prefill states of exactly one prompt (batch size 1)")
    times: list[float] = []
    per_config: list[list[torch.Tensor]] = []
    for method, budget in configs:
        start = time.perf_counter()
        per_config.append(keep_masks(states, method, budget, at_most))
        times.append(time.perf_counter() - start)
    k = len(configs)
    spec = CacheSpec(get_method("full"), 1.0, states[0].window, storage=storage)
    cache = CompressedCache.from_spec(len(states), spec)
    cache.real_prompt_tokens = states[0].lengths.repeat(k)
    for i, (layer, state) in enumerate(zip(cache.compressed_layers, states, strict=True)):
        keep = torch.cat([masks[i] for masks in per_config], dim=0)
        layer.set_prefix(state.keys.expand(k, -1, -1, -1), state.values.expand(k, -1, -1, -1), keep)
    return cache, times


def decode_budget_cache(
    states: Sequence[LayerState],
    method: Method,
    budget: Budget,
    decode: DecodeBudget,
    storage: KVQuantization | None = None,
) -> tuple[CompressedCache, float]:
    """A one-row cache of the prompt of ``states`` compressed by ``method`` at ``budget``, then held at
    ``decode.budget`` entries per KV head while it decodes (see
    :class:`~criticalkv.cache.decode.budget.DecodeCompression`).

    A decode budget re-selects with one method per cache, so such a config is not stacked with
    others. ``storage``: the quantization or ``None``. Returns the cache and the
    prompt's selection time (seconds).
    """
    cache, times = stacked_cache(states, [(method, budget)], decode.budget, storage)
    held = DecodeCompression(method, decode.budget, decode.interval, cache.window, len(states))
    held.install(cache.compressed_layers)
    for layer, state in zip(cache.compressed_layers, states, strict=True):
        held.after_prefill(layer, state)
    cache.decode = held
    return cache, times[0]


def row_kv_bytes(cache: CompressedCache) -> list[int]:
    """Bytes of keys and values each batch row holds in the compressed prompt."""
    totals: list[int] = []
    for layer in cache.compressed_layers:
        if not layer.holds_prompt:
            raise ValueError("the cache holds no compressed prompt")
        per_row = layer.segment_bytes().sum(-1)
        totals = per_row.tolist() if not totals else [a + b for a, b in zip(totals, per_row.tolist(), strict=True)]
    return [int(t) for t in totals]
