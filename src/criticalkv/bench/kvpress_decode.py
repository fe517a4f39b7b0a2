"""kvpress's decode-time compression (``DecodingPress``) beside criticalkv's decode budget: driven
one token at a time (``benchmarks/decode_compression.py``) or timed as ``criticalkv bench
--decode-budget`` times ours (:func:`measure_kvpress_decode`).

kvpress 0.5.5 compresses during decoding with ``DecodingPress(base_press, compression_interval,
target_size)``: every ``compression_interval`` decode steps, per layer, the whole cache (prompt and
generated entries) is cut back to ``target_size`` entries per KV head by the base press's scores.
``PrefillDecodingPress`` adds a prefill press, so the prompt is compressed too, as criticalkv's
``prefill budget + decode budget`` does.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from criticalkv.bench.instruments import reset_peak_memory
from criticalkv.bench.kvpress_impl import full_kv_bytes, press_label, run_press, timed_compress
from criticalkv.bench.ours import dynamic_cache_bytes
from criticalkv.bench.record import BenchRecord, measured
from criticalkv.budgets.resolve import Budget, resolve_budget

#: our method names -> a factory of kvpress's scorer press for it (window size); uniform budgets only,
#: since kvpress's AdaKV presses mask entries instead of removing them (its cache would not shrink)
KVPRESS_DECODE_METHODS: dict[str, Callable[[Any, int], Any]] = {
    "snapkv": lambda kp, window: kp.SnapKVPress(window_size=window),
    "critical-snapkv": lambda kp, window: kp.CriticalKVPress(kp.SnapKVPress(window_size=window)),
    "knorm": lambda kp, window: kp.KnormPress(),
    "streamingllm": lambda kp, window: kp.StreamingLLMPress(n_sink=4),
}


#: methods whose kvpress press scores by the last ``window`` queries: kvpress's ``DecodingPress``
#: hands them the hidden states of the last ``interval`` steps, which must outnumber the window
WINDOWED = ("snapkv", "critical-snapkv")


def kvpress_decode_unavailable(method: str, window: int, interval: int) -> str | None:
    """Why kvpress's ``DecodingPress`` cannot run ``method`` at this window and interval (``None``: it can)."""
    if method not in KVPRESS_DECODE_METHODS:
        have = ", ".join(KVPRESS_DECODE_METHODS)
        return (
            f"{method}: kvpress has no DecodingPress counterpart (uniform scorer presses only: {have}; "
            "its head-varying presses mask entries, so its cache would not shrink)"
        )
    if method in WINDOWED and interval <= window:
        return (
            f"{method}: kvpress's DecodingPress scores on the last {interval} decode steps' queries, which must "
            f"outnumber the window ({window}): give a decode interval above {window} to pair it"
        )
    return None


def kvpress_decode_press(
    kvpress: Any, method: str, *, prompt_tokens: int, prefill_budget: int, window: int, budget: int, interval: int
) -> Any:
    """kvpress's ``PrefillDecodingPress`` for ``method``: the prompt cut to ``prefill_budget`` entries,
    then the cache cut back to ``budget`` entries every ``interval`` decode steps."""
    if method not in KVPRESS_DECODE_METHODS:
        raise ValueError(f"kvpress has no decode press for {method!r}; it has: {', '.join(KVPRESS_DECODE_METHODS)}")
    if not 0 < prefill_budget <= prompt_tokens:
        raise ValueError(f"the prefill budget must be in 1..{prompt_tokens} tokens, not {prefill_budget}")
    if budget <= window or interval < 1:
        raise ValueError(f"the decode budget must exceed the window ({window}) and the interval be >= 1")
    prefill = KVPRESS_DECODE_METHODS[method](kvpress, window)
    ratio = 1.0 - prefill_budget / prompt_tokens
    if kvpress.utils.compute_n_kept(prompt_tokens, ratio) != prefill_budget:  # int() rounding: keep one more ulp
        ratio = math.nextafter(ratio, 0.0)
    if kvpress.utils.compute_n_kept(prompt_tokens, ratio) != prefill_budget:
        raise ValueError(f"no kvpress compression ratio keeps exactly {prefill_budget} of {prompt_tokens} tokens")
    prefill.compression_ratio = ratio
    decoding = kvpress.DecodingPress(
        base_press=KVPRESS_DECODE_METHODS[method](kvpress, window),
        compression_interval=interval,
        target_size=budget,
    )
    return kvpress.PrefillDecodingPress(prefilling_press=prefill if ratio > 0 else None, decoding_press=decoding)


class KvpressDecodeStream:
    """One batch-1 prompt under a kvpress press, fed one token at a time (kvpress's own way: position
    ids, no attention mask, a ``DynamicCache`` that the press shrinks in place).

    The press's hooks stay registered from :meth:`prefill` until :meth:`close` (``DecodingPress``
    counts steps per layer inside its context). ``model`` must be a plain model of its own: the
    press hooks every attention module of it.
    """

    def __init__(self, model: Any, press: Any) -> None:
        self.model = model
        self.press = press
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.peak_bytes = 0
        self.compressions = 0
        self.compress_seconds = 0.0
        self._stack = contextlib.ExitStack()
        decoding = press.decoding_press
        inner = decoding.compress

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            self.compress_seconds += time.perf_counter() - started
            self.compressions += 1
            return result

        decoding.compress = timed

    def _forward(self, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        n = int(ids.shape[1])
        position_ids = torch.arange(self.length, self.length + n, device=ids.device)[None]
        out = self.model(input_ids=ids, past_key_values=self.cache, position_ids=position_ids, **kwargs)
        self.length += n
        self.peak_bytes = max(self.peak_bytes, self.kv_bytes())
        return out.logits[:, -1].float()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Prefill (1, T) ``ids`` under the press; the (1, V) float32 logits of the last position."""
        if ids.shape[0] != 1:
            raise ValueError("KvpressDecodeStream takes one row (kvpress's DecodingPress budgets are per cache)")
        self._stack.enter_context(self.press(self.model))
        return self._forward(ids, logits_to_keep=1)

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Append one token; the (1, V) float32 logits after it."""
        return self._forward(torch.tensor([[token]], device=self.model.device))

    def kv_bytes(self) -> int:
        """Bytes of the keys and values the cache holds now."""
        return dynamic_cache_bytes(self.cache)

    def close(self) -> None:
        """Remove the press's hooks (and reset its decode buffers)."""
        self._stack.close()


@torch.no_grad()
def measure_kvpress_decode(
    kvpress: Any,
    model: Any,
    ids: torch.Tensor,
    method: str,
    budget: Budget,
    window: int,
    decode_tokens: int,
    *,
    decode_budget: int,
    decode_interval: int,
) -> BenchRecord:
    """kvpress's ``PrefillDecodingPress`` for ``method`` on the (B, T) prompt ``ids`` (no padding):
    the prompt cut to ``budget`` (a fraction or a token count, resolved as criticalkv resolves it),
    then the cache cut back to ``decode_budget`` entries per KV head every ``decode_interval``
    decode steps, timed as :func:`criticalkv.bench.ours.measure_criticalkv` times ours.

    ``model`` must be a plain (sdpa) model of its own: the press hooks every attention module of it.
    ``compress_s`` is the prompt's compression; the decode cuts are part of the timed steps.
    """
    batch, length = ids.shape
    kept = int(resolve_budget(budget, torch.tensor([length]), window)[0])
    press = kvpress_decode_press(
        kvpress,
        method,
        prompt_tokens=int(length),
        prefill_budget=kept,
        window=window,
        budget=decode_budget,
        interval=decode_interval,
    )
    spent, cuts = [0.0], [0]
    if press.prefilling_press is not None:
        press.prefilling_press.compress = timed_compress(press.prefilling_press.compress, spent, ids.device)
    inner = press.decoding_press.compress

    def counted(*args: Any, **kwargs: Any) -> Any:
        cuts[0] += 1
        return inner(*args, **kwargs)

    press.decoding_press.compress = counted
    reset_peak_memory(ids.device)
    cache = DynamicCache(config=model.config)
    run = run_press(model, press, cache, ids, decode_tokens, hold=True)
    return measured(
        "kvpress",
        method,
        ids,
        float(budget),
        ttft_s=run.ttft_s,
        compress_s=spent[0],
        step_s=run.step_s,
        decode_tokens=decode_tokens,
        kv_bytes=run.kv_bytes,
        kv_bytes_full=full_kv_bytes(model, int(batch), int(length)),
        kv_bytes_peak=run.kv_bytes_peak,
        kv_bytes_final=run.kv_bytes_final,
        bits_per_element=run.bits_per_element,
        greedy_tokens=run.greedy_tokens,
        decode=(decode_budget, decode_interval, cuts[0]),  # per layer, as ours counts its re-selections
        press=press_label(press),
    )
