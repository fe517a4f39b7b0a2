"""The same measurements through NVIDIA's kvpress (an optional benchmark dependency).

kvpress 0.5.5 requires transformers < 5.3; install it with ``pip install criticalkv[bench]``
(which pins a compatible transformers) to compare. kvpress realises head-varying budgets
(AdaKV, CriticalAdaKV) by masking: the cache keeps every entry and decoding overwrites the
evicted keys with a fake key at every step; uniform presses (SnapKV, CriticalKV, ...) shrink
the cache physically.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers import DynamicCache

from criticalkv.bench.decode import greedy_ids, timed_decode
from criticalkv.bench.instruments import now, reset_peak_memory, synchronize
from criticalkv.bench.kvpress_quantized import quantized_cache
from criticalkv.bench.ours import cache_bits_per_element, dynamic_cache_bytes
from criticalkv.bench.record import BenchRecord, measured
from criticalkv.cache.quantized import KVQuantization
from criticalkv.runtime.forward import prefill_into

logger = logging.getLogger(__name__)

#: our method names -> a factory of the equivalent kvpress press (compression ratio, window)
KVPRESS_METHODS: dict[str, Callable[[Any, float, int], Any]] = {
    "snapkv": lambda kp, ratio, window: kp.SnapKVPress(compression_ratio=ratio, window_size=window),
    "adakv": lambda kp, ratio, window: kp.AdaKVPress(kp.SnapKVPress(compression_ratio=ratio, window_size=window)),
    "critical-snapkv": lambda kp, ratio, window: kp.CriticalKVPress(
        kp.SnapKVPress(compression_ratio=ratio, window_size=window)
    ),
    "critical-adakv": lambda kp, ratio, window: kp.CriticalAdaKVPress(
        kp.SnapKVPress(compression_ratio=ratio, window_size=window)
    ),
    "pyramidkv": lambda kp, ratio, window: kp.PyramidKVPress(compression_ratio=ratio, window_size=window),
    "streamingllm": lambda kp, ratio, window: kp.StreamingLLMPress(compression_ratio=ratio),
    "knorm": lambda kp, ratio, window: kp.KnormPress(compression_ratio=ratio),
}


def import_kvpress() -> Any:
    """The ``kvpress`` module, or ``None`` (with the reason logged) if it cannot be imported."""
    try:
        import kvpress
    except Exception as err:  # ImportError, or a transformers version kvpress does not support
        logger.info("kvpress is not available (%s); pip install -e '.[bench]' to compare with it", err)
        return None
    return kvpress


def timed_compress(compress: Callable[..., Any], total: list[float], device: torch.device) -> Callable[..., Any]:
    @functools.wraps(compress)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        synchronize(device)
        started = time.perf_counter()
        result = compress(*args, **kwargs)
        synchronize(device)
        total[0] += time.perf_counter() - started
        return result

    return wrapper


def _clear_masks(model: Any) -> None:
    """Drop head-wise masks a previous kvpress run left on the attention modules."""
    for module in model.modules():
        if hasattr(module, "masked_key_indices"):
            module.masked_key_indices = None


def press_label(press: Any) -> str:
    """A short name of a kvpress press and the presses it wraps: ``CriticalKV(SnapKV)``."""
    name = type(press).__name__.removesuffix("Press")
    if name == "PrefillDecoding":
        return press_label(press.decoding_press)
    inner = getattr(press, "base_press", None) or getattr(press, "press", None)
    return name if inner is None else f"{name}({press_label(inner)})"


class PressRun(NamedTuple):
    """What :func:`run_press` measured: time to first token, KV bytes after the prefill, the most
    at any decode step, after the last step, seconds per step, and bits per element held after
    the prefill (:func:`criticalkv.bench.ours.cache_bits_per_element`), each row's greedy tokens."""

    ttft_s: float
    kv_bytes: int
    kv_bytes_peak: int
    kv_bytes_final: int
    step_s: float
    bits_per_element: float | None
    greedy_tokens: list[list[int]]


@torch.no_grad()
def run_press(
    model: Any, press: Any, cache: Any, ids: torch.Tensor, decode_tokens: int, *, hold: bool = False
) -> PressRun:
    """Prefill (B, T) ``ids`` into ``cache`` under ``press``, then decode ``decode_tokens`` greedy
    steps (with the press's hooks still in place if ``hold``: a decoding press); the bytes are
    read after every step, outside the timed span."""
    device = ids.device
    with contextlib.ExitStack() as hooks:
        hooks.enter_context(press(model))
        start = now(device)
        first = prefill_into(model, cache, ids, torch.ones_like(ids)).argmax(-1)
        ttft = now(device) - start
        if not hold:
            hooks.close()  # a prompt press: decoding runs unhooked, as kvpress's pipeline does
        kv = dynamic_cache_bytes(cache)
        bits = cache_bits_per_element(cache, ids.shape[0], _kv_width(model))
        peak = [kv]
        tokens: list[torch.Tensor] = []
        step_s = timed_decode(
            model,
            cache,
            first,
            ids.shape[1],
            decode_tokens,
            after_step=lambda: peak.append(dynamic_cache_bytes(cache)),
            tokens=tokens,
        )
    return PressRun(ttft, kv, max(peak), dynamic_cache_bytes(cache), step_s, bits, greedy_ids(first, tokens))


@torch.no_grad()
def measure_kvpress(
    kvpress: Any,
    model: Any,
    ids: torch.Tensor,
    method: str,
    budget: float,
    window: int,
    decode_tokens: int,
    *,
    storage: KVQuantization | None = None,
) -> BenchRecord:
    """Prefill under kvpress's press for ``method`` at ``budget`` (kept fraction), then decode.

    ``model`` must be a plain (sdpa) model, not one attached to criticalkv. ``storage``: our
    quantization, to hold the cache at its bits, group size and residual in transformers'
    ``QuantizedCache`` (quanto, else HQQ; :mod:`criticalkv.bench.kvpress_quantized`) instead of a
    ``DynamicCache``.
    """
    if method not in KVPRESS_METHODS:
        raise ValueError(f"kvpress has no equivalent of {method!r}; it has: {', '.join(KVPRESS_METHODS)}")
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"kvpress takes budgets as fractions in (0, 1], not {budget}")
    device = ids.device
    batch, length = ids.shape
    press = KVPRESS_METHODS[method](kvpress, 1.0 - budget, window)
    label = press_label(press)
    spent = [0.0]
    press.compress = timed_compress(press.compress, spent, device)
    _clear_masks(model)
    reset_peak_memory(device)
    cache, backend = (DynamicCache(config=model.config), "") if storage is None else quantized_cache(model, storage)
    run = run_press(model, press, cache, ids, decode_tokens)
    _clear_masks(model)
    return measured(
        "kvpress",
        method,
        ids,
        budget,
        ttft_s=run.ttft_s,
        compress_s=spent[0],
        step_s=run.step_s,
        decode_tokens=decode_tokens,
        kv_bytes=run.kv_bytes,
        kv_bytes_full=full_kv_bytes(model, batch, length),
        kv_bytes_peak=run.kv_bytes_peak,
        kv_bytes_final=run.kv_bytes_final,
        storage=storage,
        bits_per_element=run.bits_per_element,
        greedy_tokens=run.greedy_tokens,
        press=label if storage is None else f"{label}+{backend}{storage.bits}",
    )


def full_kv_bytes(model: Any, batch: int, length: int) -> int:
    """Bytes of the full cache of (batch, length) tokens in the model's dtype."""
    entry = 2 * _kv_width(model) * next(model.parameters()).element_size()
    return int(model.config.num_hidden_layers * batch * length * entry)


def _kv_width(model: Any) -> int:
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(heads) * int(head_dim)
