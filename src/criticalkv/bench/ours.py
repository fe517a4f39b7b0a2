"""Measurements of the full cache (transformers' own) and of criticalkv's compressed cache."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from criticalkv.bench.decode import timed_decode
from criticalkv.bench.measure import now, reset_peak_memory
from criticalkv.bench.record import BenchRecord, measured
from criticalkv.budgets.resolve import Budget
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.decode_compression import DEFAULT_INTERVAL
from criticalkv.methods import Method
from criticalkv.runtime.attach import attach
from criticalkv.runtime.forward import prefill_into


def dynamic_cache_bytes(cache: Any) -> int:
    """Bytes of the keys and values a transformers cache holds."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


@torch.no_grad()
def measure_full(model: Any, ids: torch.Tensor, decode_tokens: int) -> BenchRecord:
    """The reference: transformers' ``DynamicCache`` with sdpa attention, nothing evicted."""
    attach(model)  # without a criticalkv cache the attention is exactly sdpa
    device = ids.device
    length = ids.shape[1]
    reset_peak_memory(device)
    cache = DynamicCache(config=model.config)
    start = now(device)
    first = prefill_into(model, cache, ids, torch.ones_like(ids)).argmax(-1)
    ttft = now(device) - start
    kv = dynamic_cache_bytes(cache)
    step_s = timed_decode(model, cache, first, length, decode_tokens)
    return measured(
        "criticalkv",
        "full",
        ids,
        1.0,
        ttft_s=ttft,
        compress_s=0.0,
        step_s=step_s,
        decode_tokens=decode_tokens,
        kv_bytes=kv,
        kv_bytes_full=kv,
        kv_bytes_peak=dynamic_cache_bytes(cache),  # the full cache only grows
    )


@torch.no_grad()
def measure_criticalkv(
    model: Any,
    ids: torch.Tensor,
    method: str | Method,
    budget: Budget,
    window: int,
    decode_tokens: int,
    *,
    decode_budget: int | None = None,
    decode_interval: int = DEFAULT_INTERVAL,
) -> BenchRecord:
    """One prompt through criticalkv's physically compressed cache: compression in flight
    during the prefill (timed per layer, device synchronised), then greedy decoding.

    With ``decode_budget`` the cache is held at that many entries per KV head while it decodes
    (re-selected every ``decode_interval`` new entries per head); the re-selections are part of
    the timed decode steps.
    """
    attach(model)
    device = ids.device
    length = ids.shape[1]
    reset_peak_memory(device)
    cache = CompressedCache.for_model(
        model, method, budget, window=window, decode_budget=decode_budget, decode_interval=decode_interval
    )
    cache.synchronize_timing = True
    start = now(device)
    first = prefill_into(model, cache, ids, torch.ones_like(ids)).argmax(-1)
    ttft = now(device) - start
    kv, kv_full = cache.kv_bytes(), cache.kv_bytes_full()
    step_s = timed_decode(model, cache, first, length, decode_tokens)
    held = cache.decode
    return measured(
        "criticalkv",
        method if isinstance(method, str) else method.name,
        ids,
        float(budget),
        ttft_s=ttft,
        compress_s=cache.compress_seconds,
        step_s=step_s,
        decode_tokens=decode_tokens,
        kv_bytes=kv,
        kv_bytes_full=kv_full,
        kv_bytes_peak=cache.kv_bytes_peak(),
        decode=None if held is None else (held.budget, held.interval, held.reselections),
    )
