"""Decode speed of the quantized compressed cache beside the unquantized one, with a time split.

    PYTHONPATH=src python benchmarks/quantized_decode.py [--length 1024] [--budget 0.2] [--steps 32]

Prefills one random prompt into a ``critical-adakv`` cache per ``kv_bits`` (16, 8, 4), then times
single-token decode steps (interleaved rounds, median ms per token). The split: time inside the
layers' ``attend`` (all of decode attention) and, for the quantized cache, inside unpacking the
codes and applying the scales and zero points (``dequantize``: the two together, as the code before
the tiled kernel named them). ``attend_vs_16_bit_*``: the quantized ``attend`` time over the
unquantized one of the same round (interleaved, same process), best and median round. Prints one
JSON line per ``kv_bits``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import criticalkv as ckv
from criticalkv.cache import quantized_attention, quantized_store
from criticalkv.cache.layer import CompressedLayer
from criticalkv.cache.quant_spec import bits_per_element
from criticalkv.cache.quantized_layer import QuantizedLayer
from criticalkv.cache.quantized_store import QuantizedBlocks
from criticalkv.compat import cache_argument

TIMERS: dict[str, float] = defaultdict(float)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[name] += time.perf_counter() - start

    return wrapper


def _instrument() -> None:
    """Time the kernel's parts, in the tiled kernel (unpack, dequantize_keys/values) or in the
    per-tier one it replaced (QuantizedBlocks.dequantize wrapping quantize.unpack)."""
    for name in ("unpack", "dequantize_keys", "dequantize_values"):
        if hasattr(quantized_attention, name):
            label = "unpack" if name == "unpack" else "scale_zero"
            setattr(quantized_attention, name, timed(label, getattr(quantized_attention, name)))
    if hasattr(QuantizedBlocks, "dequantize"):
        QuantizedBlocks.dequantize = timed("dequantize", QuantizedBlocks.dequantize)  # type: ignore[method-assign]
        quantized_store.unpack = timed("unpack", quantized_store.unpack)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    CompressedLayer.attend = timed("attend", CompressedLayer.attend)  # type: ignore[method-assign]
    QuantizedLayer.attend = timed("attend", QuantizedLayer.attend)  # type: ignore[method-assign]
    _instrument()
    model, _ = ckv.load_model("default")
    model = ckv.attach(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (1, args.length), generator=g)
    mask = torch.ones_like(ids)
    per_step: dict[int, list[float]] = defaultdict(list)
    attend_rounds: dict[int, list[float]] = defaultdict(list)
    split: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    info: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for bits in (16, 8, 4):
                cache = ckv.CompressedCache.for_model(model, "critical-adakv", args.budget, kv_bits=bits)
                out = model(input_ids=ids, attention_mask=mask, **cache_argument(model, cache))
                token = out.logits[:, -1:].argmax(-1)
                m = mask
                TIMERS.clear()
                start = time.perf_counter()
                for _ in range(args.steps):
                    m = torch.cat([m, torch.ones(1, 1, dtype=m.dtype)], 1)
                    out = model(input_ids=token, attention_mask=m, **cache_argument(model, cache))
                    token = out.logits[:, -1:].argmax(-1)
                per_step[bits].append(1000 * (time.perf_counter() - start) / args.steps)
                for name, seconds in TIMERS.items():
                    split[bits][name] += 1000 * seconds / args.steps / args.rounds
                attend_rounds[bits].append(TIMERS["attend"])
                info[bits] = {"kv_bytes": cache.kv_bytes(), "bits_per_element": bits_per_element(cache)}
    base = statistics.median(per_step[16])
    ratios = {b: [a / u for a, u in zip(attend_rounds[b], attend_rounds[16], strict=True)] for b in attend_rounds}
    for bits in (16, 8, 4):
        ms = statistics.median(per_step[bits])
        record = {
            "kv_bits": bits,
            "length": args.length,
            "budget": args.budget,
            "steps": args.steps,
            "rounds": args.rounds,
            "ms_per_token_median": round(ms, 2),
            "ms_per_token_rounds": [round(x, 2) for x in per_step[bits]],
            "vs_16_bit": round(ms / base, 3),
            "attend_ms_per_token": round(split[bits]["attend"], 2),
            "unpack_ms_per_token": round(split[bits].get("unpack", 0.0), 2),
            "dequantize_ms_per_token": round(
                split[bits].get("dequantize", split[bits].get("unpack", 0.0) + split[bits].get("scale_zero", 0.0)), 2
            ),
            "attend_vs_16_bit_best": round(min(ratios[bits]), 3),
            "attend_vs_16_bit_median": round(statistics.median(ratios[bits]), 3),
            **info[bits],
        }
        print(json.dumps(record))


if __name__ == "__main__":
    main()
