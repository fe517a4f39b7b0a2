"""Decode ms/token of several caches stepped in turn (same moment, same load), with a cProfile per cache.

Each spec is ``full`` or ``METHOD@BUDGET`` (the prefill budget: ``1.0`` keeps the whole prompt, an
int is entries per head); every compressed cache is held at ``--decode-budget`` while it decodes.
All caches are fed the full cache's greedy tokens. Prints per cache the median and the fastest step
and the re-selection seconds, then each cache's top functions by own time.

    PYTHONPATH=src python benchmarks/decode_interleaved.py --steps 200 full snapkv@1.0 snapkv@512 adakv@512
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from criticalkv import CompressedCache, attach, load_model
from criticalkv.bench.decode import Lockstep, prefill_logits
from criticalkv.bench.prompt import prompt_ids


def make(model: torch.nn.Module, spec: str, decode_budget: int, interval: int) -> CompressedCache:
    if spec == "full":
        return CompressedCache.for_model(model, "full", 1.0, window=32)
    method, budget = spec.split("@")
    kept = float(budget) if "." in budget else int(budget)
    return CompressedCache.for_model(
        model, method, kept, window=32, decode_budget=decode_budget, decode_interval=interval
    )


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-budget", type=int, default=512)
    parser.add_argument("--decode-interval", type=int, default=64)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("default")
    attach(model)
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    caches = {s: make(model, s, args.decode_budget, args.decode_interval) for s in ["full", *args.specs] if s}
    lockstep = Lockstep.after(ids)
    for cache in caches.values():
        logits = prefill_logits(model, cache, ids)
    token = logits.argmax(-1, keepdim=True)
    ms: dict[str, list[float]] = {s: [] for s in caches}
    profiles = {s: cProfile.Profile() for s in caches}
    for _ in range(args.steps):
        lockstep.advance()
        for spec, cache in caches.items():
            started = time.perf_counter()
            profiles[spec].enable()
            logits = lockstep.step(model, cache, token)
            profiles[spec].disable()
            ms[spec].append(1000 * (time.perf_counter() - started))
            if spec == "full":
                nxt = logits.argmax(-1, keepdim=True)
        token = nxt
    for spec, cache in caches.items():
        reselect = None if cache.decode is None else round(cache.decode.seconds, 2)
        median, fastest = statistics.median(ms[spec]), min(ms[spec])
        print(f"{spec}: median {median:.1f} ms, fastest {fastest:.1f} ms, re-select s {reselect}")
    for spec in caches:
        print(f"===== {spec}")
        pstats.Stats(profiles[spec]).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
