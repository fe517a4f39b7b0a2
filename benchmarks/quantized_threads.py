"""The C decode kernel's attention alone, at 1 and at N torch threads: one layer of the default
model's shapes (3 KV heads of dimension 64, 3 query rows each), a 4-bit ragged prefix of about 20%
of the prompt (heads at 15/20/25%), best of many calls, interleaved.

    PYTHONPATH=src python benchmarks/quantized_threads.py --prompt-tokens 4096 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from criticalkv.cache.quantized.codec import value_group
from criticalkv.cache.quantized.paged import paged_quantized
from criticalkv.cache.quantized.prefix import build_quantized_prefix
from criticalkv.ops.cpu import build, c_ragged_decode


def layout(tokens: int, bits: int, group: int, seed: int = 0) -> dict:
    """The op's arguments for one layer: a ragged quantized prefix through its block table, a
    32-entry dense tail and the queries (segments in sorted order, as the storage passes them)."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 3, tokens, 64, generator=g), torch.randn(1, 3, tokens, 64, generator=g)
    keep = torch.rand(1, 3, tokens, generator=g) < torch.tensor([0.15, 0.2, 0.25]).view(1, 3, 1)
    prefix = build_quantized_prefix(keys, values, keep, bits, group)
    pool = prefix.decode_pool()
    assert pool is not None
    paged = paged_quantized(prefix, pool, group)
    return {
        "query": torch.randn(3, 3, 64, generator=g),
        "key_pool": pool.key_codes,
        "value_pool": pool.value_codes,
        "block_table": paged.table,
        "lengths": paged.lengths,
        "block_size": group,
        "scaling": 0.125,
        "tail_keys": torch.randn(3, 32, 64, generator=g),
        "tail_values": torch.randn(3, 32, 64, generator=g),
        "bits": bits,
        "key_scale": pool.key_scale,
        "key_zero": pool.key_zero,
        "value_scale": pool.value_scale,
        "value_zero": pool.value_zero,
        "value_group": value_group(group, 64),
        "entry_starts": paged.entry_starts,
    }


def timed_call(library: object, x: dict) -> float:
    start = time.perf_counter()
    c_ragged_decode(library, **x)  # type: ignore[arg-type]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bits", type=int, default=4, choices=[8, 4])
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds of --calls calls per thread count")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    library = build.load_library()
    if isinstance(library, str):
        raise SystemExit(f"the C kernel is unavailable: {library}")
    x = layout(args.prompt_tokens, args.bits, args.group)
    best: dict[int, list[float]] = {1: [], args.threads: []}
    for _ in range(args.rounds):
        for n in best:
            torch.set_num_threads(n)
            best[n].append(min(timed_call(library, x) for _ in range(args.calls)))
    one, many = min(best[1]), min(best[args.threads])
    ratios = [a / b for a, b in zip(best[1], best[args.threads], strict=True)]
    print(
        f"{args.prompt_tokens} tokens, {args.bits} bits, group {args.group}: 1 thread {one * 1e6:.1f} us, "
        f"{args.threads} threads {many * 1e6:.1f} us (best of {args.rounds * args.calls}); speed-up {one / many:.2f}x, "
        f"median of the rounds' ratios {statistics.median(ratios):.2f}x"
    )


if __name__ == "__main__":
    main()
