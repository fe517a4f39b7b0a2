"""Measurements of the full cache (transformers' own) and of criticalkv's compressed cache."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from criticalkv.bench.decode import greedy_ids, timed_decode
from criticalkv.bench.instruments import now, reset_peak_memory
from criticalkv.bench.record import BenchRecord, measured
from criticalkv.cache import CacheSpec, bind_spec
from criticalkv.cache.quantized import bits_per_element
from criticalkv.runtime.attach import attach
from criticalkv.runtime.compress import compress_prompt
from criticalkv.runtime.forward import prefill_into


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` holds; a wrapper subclass (quanto's packed tensors) counts its inner tensors."""
    if hasattr(tensor, "__tensor_flatten__"):  # a traceable wrapper: its data, scales, zero points
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


#: where transformers' cache layers hold keys and values (a ``QuantizedCache`` layer: the
#: full-precision residual in ``keys``/``values``, the rest in ``_quantized_keys``/``_quantized_values``)
_KV_ATTRIBUTES = ("keys", "values", "_quantized_keys", "_quantized_values")


def state_bytes(state: Any) -> int:
    """Bytes of one state a transformers cache layer holds: a tensor (quanto's packed tensor: its
    data, scales and zero points), HQQ's ``(codes, meta)`` pair (the codes and every tensor of
    ``meta``: scale and zero point); anything else (``None``: nothing held yet) holds 0."""
    if isinstance(state, torch.Tensor):
        return tensor_bytes(state)
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        codes, meta = state
        return state_bytes(codes) + sum(tensor_bytes(v) for v in meta.values() if isinstance(v, torch.Tensor))
    return 0


def dynamic_cache_bytes(cache: Any) -> int:
    """Bytes of the keys and values a transformers cache holds (quantized data, scales and zero
    points included for a ``QuantizedCache``, quanto or HQQ, and its exact residual)."""
    return sum(state_bytes(getattr(layer, name, None)) for layer in cache.layers for name in _KV_ATTRIBUTES)


def cache_bits_per_element(cache: Any, batch: int, kv_width: int) -> float | None:
    """Bits per key or value element a transformers cache holds (its bytes over the entries each
    layer holds: ``get_seq_length()`` tokens x ``batch`` rows x ``kv_width``, KV heads x head
    dimension); a cache that masks evicted entries instead of removing them counts them all.
    ``None`` if it holds nothing."""
    elements = 2 * sum(layer.get_seq_length() for layer in cache.layers) * batch * kv_width
    return 8.0 * dynamic_cache_bytes(cache) / elements if elements else None


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
    tokens: list[torch.Tensor] = []
    step_s = timed_decode(model, cache, first, length, decode_tokens, tokens=tokens)
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
        kv_bytes_final=dynamic_cache_bytes(cache),
        greedy_tokens=greedy_ids(first, tokens),
    )


@torch.no_grad()
def measure_criticalkv(model: Any, ids: torch.Tensor, spec: CacheSpec, decode_tokens: int) -> BenchRecord:
    """One prompt through criticalkv's physically compressed cache built from ``spec``: compression
    in flight during the prefill (timed per layer, device synchronised), then greedy decoding.

    With a decode budget (``spec.decode``) the cache is held at it while it decodes; the
    re-selections are part of the timed decode steps. With ``spec.storage`` the kept entries are
    stored quantized. A head-prior method is bound to ``model`` here if it is not yet.
    """
    attach(model)
    device = ids.device
    length = ids.shape[1]
    reset_peak_memory(device)
    spec = bind_spec(spec, model)
    start = now(device)
    cache, last = compress_prompt(model, ids, torch.ones_like(ids), spec, synchronize_timing=True)
    first = last.argmax(-1)
    ttft = now(device) - start
    kv, kv_full, bits = cache.kv_bytes(), cache.kv_bytes_full(), bits_per_element(cache)
    tokens: list[torch.Tensor] = []
    step_s = timed_decode(model, cache, first, length, decode_tokens, tokens=tokens)
    held = cache.decode
    return measured(
        "criticalkv",
        spec.method.name,
        ids,
        float(spec.budget),
        ttft_s=ttft,
        compress_s=cache.compress_seconds,
        step_s=step_s,
        decode_tokens=decode_tokens,
        kv_bytes=kv,
        kv_bytes_full=kv_full,
        kv_bytes_peak=cache.kv_bytes_peak(),
        decode=None if held is None else (held.budget, held.interval, held.reselections),
        kv_bytes_final=cache.kv_bytes(),
        storage=spec.storage,
        bits_per_element=bits,
        greedy_tokens=greedy_ids(first, tokens),
    )
