"""Decode speed of the quantized compressed cache beside the unquantized one, with a time split.

    PYTHONPATH=src python benchmarks/quantized_decode.py [--length 1024] [--budget 0.2] [--steps 32]

Prefills one random prompt into a ``critical-adakv`` cache per ``kv_bits`` (16, 8, 4), then times
single-token decode steps, the three storages interleaved round by round in one process. Each
round records the whole decode step (the model's forward, ms per token) and the time inside the
layers' ``attend`` (all of decode attention), both as wall time and as this thread's CPU time
(``time.thread_time``: what the step itself computed, robust to other processes' load). The
``*_vs_16_bit_*`` ratios divide the quantized figure by the unquantized one *of the same round*
(best and median round). The split names the parts of the decode op's CPU implementation:
``c_kernel`` (the compiled C kernel's whole call), ``reference`` (the op's torch reference, where
``CRITICALKV_KERNEL=torch`` or the inputs send it there) and ``tail_dequantize`` (the quantized
tail blocks dequantized into the op's dense tail). Prints one JSON line per ``kv_bits``.
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
from criticalkv.cache.layer import CompressedLayer
from criticalkv.cache.quantized import QuantizedStorage, bits_per_element
from criticalkv.cache.quantized.code_blocks import QuantizedBlocks
from criticalkv.compat import cache_argument
from criticalkv.ops.cpu import kernel as cpu_kernel

WALL: dict[str, float] = defaultdict(float)
CPU: dict[str, float] = defaultdict(float)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            WALL[name] += time.perf_counter() - wall
            CPU[name] += time.thread_time() - cpu

    return wrapper


def _instrument() -> None:
    """Time the op's parts named in the module docstring."""
    cpu_kernel._call = timed("c_kernel", cpu_kernel._call)  # type: ignore[method-assign]
    cpu_kernel.ragged_decode_reference = timed("reference", cpu_kernel.ragged_decode_reference)  # type: ignore[method-assign]
    QuantizedBlocks.dequantize = timed("tail_dequantize", QuantizedBlocks.dequantize)  # type: ignore[method-assign]


def _ratios(rounds: dict[int, list[float]], bits: int) -> dict[str, float]:
    r = [a / u for a, u in zip(rounds[bits], rounds[16], strict=True)]
    return {"best": round(min(r), 3), "median": round(statistics.median(r), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--method", default="critical-adakv")
    parser.add_argument("--no-split", action="store_true", help="do not time the kernel's parts (less overhead)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    CompressedLayer.attend = timed("attend", CompressedLayer.attend)  # type: ignore[method-assign]
    QuantizedStorage.attend = timed("attend", QuantizedStorage.attend)  # type: ignore[method-assign]
    if not args.no_split:
        _instrument()
    model, _ = ckv.load_model("default")
    model = ckv.attach(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (1, args.length), generator=g)
    mask = torch.ones_like(ids)
    rounds: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    split: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    info: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for bits in (16, 8, 4):
                cache = ckv.CompressedCache.for_model(model, args.method, args.budget, kv_bits=bits)
                out = model(input_ids=ids, attention_mask=mask, **cache_argument(model, cache))
                token = out.logits[:, -1:].argmax(-1)
                m = mask
                WALL.clear()
                CPU.clear()
                wall, cpu = time.perf_counter(), time.thread_time()
                for _ in range(args.steps):
                    m = torch.cat([m, torch.ones(1, 1, dtype=m.dtype)], 1)
                    out = model(input_ids=token, attention_mask=m, **cache_argument(model, cache))
                    token = out.logits[:, -1:].argmax(-1)
                rounds["step_wall"][bits].append(1000 * (time.perf_counter() - wall) / args.steps)
                rounds["step_cpu"][bits].append(1000 * (time.thread_time() - cpu) / args.steps)
                rounds["attend_wall"][bits].append(1000 * WALL["attend"] / args.steps)
                rounds["attend_cpu"][bits].append(1000 * CPU["attend"] / args.steps)
                for name, seconds in CPU.items():
                    split[bits][name] += 1000 * seconds / args.steps / args.rounds
                info[bits] = {"kv_bytes": cache.kv_bytes(), "bits_per_element": bits_per_element(cache)}
    for bits in (16, 8, 4):
        record: dict[str, Any] = {
            "kv_bits": bits,
            "method": args.method,
            "length": args.length,
            "budget": args.budget,
            "steps": args.steps,
            "rounds": args.rounds,
            "split_timed": not args.no_split,
        }
        for key, per_bits in rounds.items():
            record[f"{key}_ms_median"] = round(statistics.median(per_bits[bits]), 3)
            record[f"{key}_ms_rounds"] = [round(x, 3) for x in per_bits[bits]]
            record[f"{key}_vs_16_bit"] = _ratios(per_bits, bits)
        record["split_cpu_ms_per_token"] = {k: round(v, 3) for k, v in sorted(split[bits].items())}
        record.update(info[bits])
        print(json.dumps(record))


if __name__ == "__main__":
    main()
