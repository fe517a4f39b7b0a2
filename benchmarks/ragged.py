"""Ragged vs uniform decode at equal bytes: one layer's append + attention step, default model shapes.

Each layout holds the same kept entries per batch row (``0.2 x T`` per KV head on average):

* ``uniform``: every head keeps ``k`` entries (SnapKV's layout; one length bucket, one sdpa call);
* ``ragged, tiers``: heads keep ``0.5k, k, 1.5k`` (rotated per row; AdaKV-like), read through the
  staircase tiers and a separate tail (``ragged_attention``: the path every ragged layer took
  before the length buckets, and the one a ``fork()`` still takes);
* ``ragged, buckets``: the same layout through the length buckets (``cache/layouts/length_buckets.py``: one
  dense prefix+tail buffer and one sdpa call per distinct length), what an owned layer uses now.

A step is ``layer.append`` of one token per head plus ``layer.attend`` of its queries, over a
tail of 16 earlier tokens (the tail length is reset after each step so every step sees the same
cache). Variants are interleaved within each repeat so that load on a shared machine hits them
alike; each repeat times ``--inner`` steps, and the best and the median repeat are reported.

Run: ``python benchmarks/ragged.py [--lengths 4096,8192] [--batch 1] [--threads 2] [--repeats 15] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from criticalkv.cache.layer import CompressedLayer

H_KV, GROUP, HEAD_DIM = 3, 3, 64  # SmolLM2-135M-Instruct
TAIL = 16
SHARES = (0.5, 1.0, 1.5)


def _keep(batch: int, t: int, kept: int, ragged: bool, gen: torch.Generator) -> torch.Tensor:
    keep = torch.zeros(batch, H_KV, t, dtype=torch.bool)
    for b in range(batch):
        for h in range(H_KV):
            share = SHARES[(h + b) % H_KV] if ragged else 1.0
            keep[b, h, torch.randperm(t, generator=gen)[: int(share * kept)]] = True
    return keep


def _layer(batch: int, t: int, layout: str, gen: torch.Generator) -> CompressedLayer:
    keys = torch.randn(batch, H_KV, t, HEAD_DIM, generator=gen)
    values = torch.randn(batch, H_KV, t, HEAD_DIM, generator=gen)
    layer = CompressedLayer(0)
    layer.set_prefix(keys, values, _keep(batch, t, int(0.2 * t), layout != "uniform", gen))
    if layout == "ragged, tiers":
        layer.storage.owns_prefix = False  # a fork's read path: the tiers and a plain tail
    tail = torch.randn(batch, H_KV, TAIL, HEAD_DIM, generator=gen)
    layer.append(tail, tail)
    return layer


def _step(layer: CompressedLayer, gen: torch.Generator) -> Callable[[], object]:
    batch = layer.batch_size
    new = torch.randn(batch, H_KV, 1, HEAD_DIM, generator=gen)
    query = torch.randn(batch, H_KV * GROUP, 1, HEAD_DIM, generator=gen)

    def step() -> object:
        layer.append(new, new)
        out = layer.attend(query, None, HEAD_DIM**-0.5)
        layer.tail_len -= 1  # the next step sees the same cache
        return out

    return step


def _buckets(layer: CompressedLayer) -> int | None:
    """How many length buckets the layer decodes from (None: the tier path; also on checkouts from
    before the buckets, whose uniform layers held a (keys, values) pair, so that this script can time
    them too)."""
    buckets = getattr(layer.storage.fused, "buckets", None)
    return None if buckets is None else len(buckets)


def one_length(t: int, batch: int, repeats: int, inner: int, gen: torch.Generator) -> list[dict[str, object]]:
    layouts = ("uniform", "ragged, tiers", "ragged, buckets")
    layers = {name: _layer(batch, t, name, gen) for name in layouts}
    steps = {name: _step(layer, gen) for name, layer in layers.items()}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for fn in steps.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in steps.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner * 1e3)
    rows = []
    uniform_best, uniform_median = min(times["uniform"]), statistics.median(times["uniform"])
    for name in layouts:
        best, median = min(times[name]), statistics.median(times[name])
        rows.append(
            {
                "layout": name,
                "tokens": t,
                "batch": batch,
                "kv_bytes": layers[name].nbytes(),
                "buckets": _buckets(layers[name]),
                "best_ms": best,
                "median_ms": median,
                "best_vs_uniform": best / uniform_best,
                "median_vs_uniform": median / uniform_median,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    lengths = [int(t) for t in args.lengths.split(",")]
    rows = [row for t in lengths for row in one_length(t, args.batch, args.repeats, args.inner, gen)]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"torch {torch.__version__}, {args.threads} threads, batch {args.batch}, {args.repeats} x {args.inner} steps")
    print(
        f"{'layout':<16} {'tokens':>6} {'KV bytes':>9} {'buckets':>7} {'best ms':>8} {'median ms':>9} "
        f"{'best/u':>6} {'med/u':>6}"
    )
    for r in rows:
        print(
            f"{r['layout']:<16} {r['tokens']:>6} {r['kv_bytes']:>9} {r['buckets']!s:>7} {r['best_ms']:>8.3f} "
            f"{r['median_ms']:>9.3f} {r['best_vs_uniform']:>6.2f} {r['median_vs_uniform']:>6.2f}"
        )


if __name__ == "__main__":
    main()
