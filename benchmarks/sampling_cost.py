"""What choosing a token costs the server per row and step: greedy vs sampled (top-p or not).

``TokenChooser.choose`` on (V,) float32 logits, V = 49,152 (SmolLM2's vocabulary), logits drawn
once from a fixed seed, peaked (standard deviation 4) or nearly flat (0.1: the top-p set is
most of the vocabulary, the worst case); the median and the minimum over ``--repeats`` calls.

Run: ``python benchmarks/sampling_cost.py [--vocab 49152] [--repeats 300] [--threads 1] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from criticalkv.serve.sampling import Sampling, TokenChooser

CASES = {
    "greedy": Sampling(),
    "temperature=1": Sampling(1.0, 1.0, seed=0),
    "temperature=1 top_p=0.9": Sampling(1.0, 0.9, seed=0),
    "temperature=0.7 top_p=0.5": Sampling(0.7, 0.5, seed=0),
}


def measure(vocab: int, repeats: int) -> dict[str, dict[str, float]]:
    out = {}
    for spread, (name, sampling) in [(s, case) for s in (4.0, 0.1) for case in CASES.items()]:
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * spread
        chooser = TokenChooser(sampling)
        for _ in range(10):  # warm-up
            chooser.choose(logits)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            chooser.choose(logits)
            times.append(time.perf_counter() - start)
        out[f"{name}, logits std {spread}"] = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args.vocab, args.repeats)
    if args.json:
        print(json.dumps({"vocab": args.vocab, "repeats": args.repeats, "threads": args.threads, "cases": result}))
        return
    for name, row in result.items():
        print(f"{name:44s} median {row['median_ms']:.3f} ms  min {row['min_ms']:.3f} ms")


if __name__ == "__main__":
    main()
