"""The ragged decode path at the model level: head-varying caches beside a uniform one, stepped in turn.

    PYTHONPATH=src python benchmarks/ragged_decode.py --prompt-tokens 4096 --steps 64 \
        snapkv@0.2 adakv@0.2 critical-adakv@0.2 defensivekv@0.2 [--kv-bits 4] [--out FILE]

Each spec is ``METHOD@BUDGET[:BITS][/KERNEL]``; the first is the reference (a uniform layout such as
SnapKV's, or the same method unquantized to time quantized storage against it).
Every cache is prefilled with the same natural-text prompt at the same budget, so they hold the
same bytes (printed), then all decode the same greedy tokens (the reference's), one step of each
cache in turn: the caches see the same moment and the same load. Per step the model's whole decode
forward is timed on the wall clock and on this thread's CPU clock (``time.thread_time``, which
does not count time the thread waits for a core). The figure is the median over steps of the
paired ratio (cache / reference in the same step), with a 95% bootstrap interval of that median;
``--kv-bits`` stores every cache's kept entries in 8 or 4 bits unless its spec says ``:BITS``
(16, 8 or 4). ``/c`` or ``/torch`` runs that cache's steps (prefill included) with
``CRITICALKV_KERNEL`` set to it, so the op's C kernel and torch reference can be paired in one
process (``critical-adakv@0.2:4/torch critical-adakv@0.2:4/c``); ``/op`` or ``/native`` sets
``CRITICALKV_DECODE`` instead, pairing a 16-bit layout through the op with its own CPU kernels
(``adakv@0.2/native adakv@0.2/op``). A spec ending in ``+cancel`` decodes with
the server's hang-up check (``serve/cancel.py``) before every decoder layer, as ``criticalkv serve``
runs its decode steps (``critical-adakv@0.2 critical-adakv@0.2+cancel``: the check's cost). One JSON
line per cache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from criticalkv import CompressedCache, attach, load_model
from criticalkv.bench.decode import Lockstep, prefill_logits
from criticalkv.bench.prompt import prompt_ids
from criticalkv.ops import DECODE_ENV
from criticalkv.ops.cpu.build import KERNEL_ENV
from criticalkv.serve.cancel import check_cancelled

CANCEL = "+cancel"


def cancel_hooks(model: torch.nn.Module, spec: str) -> list[Any]:
    """For a ``+cancel`` spec, the server's hang-up check put before every decoder layer (handles to
    remove it after the step); no hooks otherwise."""
    if not spec.endswith(CANCEL):
        return []
    return [layer.register_forward_pre_hook(check_cancelled) for layer in model.get_decoder().layers]


#: a spec's ``/CHOICE``: the environment variable it sets for that cache's steps
CHOICES = {"c": KERNEL_ENV, "torch": KERNEL_ENV, "op": DECODE_ENV, "native": DECODE_ENV}


def kernel_of(spec: str) -> str | None:
    """The ``/CHOICE`` of a spec (``c``, ``torch``, ``op`` or ``native``), or ``None``."""
    _, _, kernel = spec.removesuffix(CANCEL).partition("/")
    if kernel and kernel not in CHOICES:
        raise ValueError(f"a spec's choice is /c, /torch, /op or /native, not {spec!r}")
    return kernel or None


def use_kernel(spec: str) -> None:
    """Set ``CRITICALKV_KERNEL`` or ``CRITICALKV_DECODE`` for ``spec``'s steps (both unset when it
    names neither)."""
    kernel = kernel_of(spec)
    os.environ.pop(KERNEL_ENV, None)
    os.environ.pop(DECODE_ENV, None)
    if kernel is not None:
        os.environ[CHOICES[kernel]] = kernel


def parse(spec: str, kv_bits: int) -> tuple[str, float | int, int]:
    """``METHOD@BUDGET[:BITS][/KERNEL]`` as (method, budget, bits); ``kv_bits`` when the spec names none."""
    method, _, rest = spec.removesuffix(CANCEL).partition("/")[0].partition("@")
    budget, _, bits = rest.partition(":")
    if not method or not budget or (bits and bits not in ("16", "8", "4")):
        raise ValueError(f"a spec is METHOD@BUDGET[:BITS] with BITS 16, 8 or 4, e.g. adakv@0.2:4, not {spec!r}")
    return method, float(budget) if "." in budget else int(budget), int(bits) if bits else kv_bits


def make(model: torch.nn.Module, spec: str, kv_bits: int) -> CompressedCache:
    method, kept, bits = parse(spec, kv_bits)
    return CompressedCache.for_model(model, method, kept, window=32, kv_bits=bits)


def median_interval(ratios: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``ratios``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="METHOD@BUDGET[:BITS]; the first is the reference")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=4, help="steps run but not counted")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--kv-bits", type=int, default=16, choices=[16, 8, 4])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines here too")
    args = parser.parse_args()
    if len(args.specs) < 2:
        parser.error("give a reference spec and at least one more, e.g. snapkv@0.2 adakv@0.2")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("default")
    attach(model)
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    caches = {s: make(model, s, args.kv_bits) for s in args.specs}
    lockstep = Lockstep.after(ids)
    token = None
    for spec, cache in caches.items():
        use_kernel(spec)
        logits = prefill_logits(model, cache, ids)
        if token is None:
            token = logits.argmax(-1, keepdim=True)
    wall: dict[str, list[float]] = {s: [] for s in caches}
    cpu: dict[str, list[float]] = {s: [] for s in caches}
    reference = args.specs[0]
    for step in range(args.warmup + args.steps):
        lockstep.advance()
        order = list(caches.items())
        if step % 2:  # alternate who goes first, so no cache always runs right after another
            order.reverse()
        nxt = token
        for spec, cache in order:
            use_kernel(spec)
            hooks = cancel_hooks(model, spec)
            started_wall, started_cpu = time.perf_counter(), time.thread_time()
            logits = lockstep.step(model, cache, token)
            took_wall, took_cpu = time.perf_counter() - started_wall, time.thread_time() - started_cpu
            for hook in hooks:
                hook.remove()
            if step >= args.warmup:
                wall[spec].append(1000 * took_wall)
                cpu[spec].append(1000 * took_cpu)
            if spec == reference:
                nxt = logits.argmax(-1, keepdim=True)
        token = nxt
    for spec, cache in caches.items():
        record: dict[str, Any] = {
            "spec": spec,
            "reference": reference,
            "prompt_tokens": args.prompt_tokens,
            "kv_bits": parse(spec, args.kv_bits)[2],
            "kernel": kernel_of(spec),
            "cancel_check": spec.endswith(CANCEL),
            "kv_bytes": cache.kv_bytes(),
            "steps": args.steps,
            "threads": args.threads,
            "wall_ms_median": statistics.median(wall[spec]),
            "cpu_ms_median": statistics.median(cpu[spec]),
            "wall_ms_steps": [round(x, 4) for x in wall[spec]],  # per step, for pairing any two caches offline
            "cpu_ms_steps": [round(x, 4) for x in cpu[spec]],
        }
        for clock, times in (("wall", wall), ("cpu", cpu)):
            ratios = [a / b for a, b in zip(times[spec], times[reference], strict=True)]
            low, high = median_interval(ratios)
            record |= {f"{clock}_ratio_median": statistics.median(ratios), f"{clock}_ratio_ci": [low, high]}
        line = json.dumps(record)
        print(line)
        if args.out is not None:
            with args.out.open("a", encoding="utf-8") as handle:
                handle.write(line + "\n")


if __name__ == "__main__":
    main()
