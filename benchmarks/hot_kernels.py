"""Before/after micro-benchmarks of the two hot kernels, on the default model's shapes.

* value norms ``||V W_O^h||_1`` over a whole layer (the Critical selection's extra work): the
  previous kernel (one (B, H_kv, G, c, D) product per 32 MB chunk, then ``abs()`` and ``sum``),
  the current exact kernel (one (B, H_kv, c, G*D) product per cache-sized chunk, in-place
  ``abs_``) and the current kernel in bfloat16 (what ``precision="auto"`` picks on CPUs with
  AVX512-BF16);
* decode attention of one layer and one step over a 20% ragged cache: the previous kernel
  (online softmax merged tier by tier), the current one (one softmax over all tiers), and sdpa
  over the full cache (what the uncompressed model does).

Run: ``python benchmarks/hot_kernels.py [--threads 2] [--json]``; best of several repeats.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from criticalkv.cache.layouts import Tier, build_prefix, ragged_attention
from criticalkv.scores.value_norms import projected_value_norms

H_KV, GROUP, HEAD_DIM, HIDDEN = 3, 3, 64, 576  # SmolLM2-135M-Instruct


def previous_value_norms(values: torch.Tensor, weight: torch.Tensor, max_chunk_bytes: int = 1 << 25) -> torch.Tensor:
    """The kernel of criticalkv 0.1.0 (before the performance work), kept for comparison."""
    b, h_kv, t, d = values.shape
    hidden = weight.shape[0]
    g = weight.shape[1] // d // h_kv
    w_o = weight.view(hidden, h_kv, g, d).permute(1, 2, 3, 0)
    chunk = max(1, max_chunk_bytes // (b * h_kv * g * hidden * values.element_size()))
    out = torch.empty(b, h_kv, t)
    for start in range(0, t, chunk):
        projected = torch.matmul(values[:, :, None, start : start + chunk, :], w_o[None])
        out[:, :, start : start + chunk] = projected.abs().sum(-1, dtype=torch.float32).mean(dim=2)
    return out


def previous_ragged_attention(
    query: torch.Tensor, tiers: list[Tier], tail_k: torch.Tensor, tail_v: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The decode kernel of criticalkv 0.1.0: online softmax, merged tier by tier."""
    s, nq, d = query.shape
    m = torch.full((s, nq), float("-inf"))
    lse = torch.zeros((s, nq))
    acc = torch.zeros((s, nq, d))

    def merge(m: torch.Tensor, lse: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, v: torch.Tensor) -> None:
        new_m = torch.maximum(m, scores.amax(dim=-1))
        new_m = torch.where(torch.isfinite(new_m), new_m, torch.zeros_like(new_m))
        p = torch.exp(scores - new_m[..., None])
        rescale = torch.exp(m - new_m)
        lse.mul_(rescale).add_(p.sum(-1))
        acc.mul_(rescale[..., None]).add_(torch.matmul(p, v))
        m.copy_(new_m)

    for tier in tiers:
        n = tier.num_segments
        merge(m[:n], lse[:n], acc[:n], torch.matmul(query[:n], tier.keys.transpose(1, 2)) * scaling, tier.values)
    merge(m, lse, acc, torch.matmul(query, tail_k.transpose(1, 2)) * scaling, tail_v)
    return acc / lse[..., None]


def best_ms(fn: Callable[[], object], repeats: int, inner: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best * 1e3


def _row(kernel: str, variant: str, tokens: int, ms: float) -> dict[str, object]:
    return {"kernel": kernel, "variant": variant, "tokens": tokens, "ms": ms}


def one_length(t: int, repeats: int, gen: torch.Generator) -> list[dict[str, object]]:
    """Every kernel variant at a context of ``t`` tokens."""
    values = torch.randn(1, H_KV, t, HEAD_DIM, generator=gen)
    weight = torch.randn(HIDDEN, H_KV * GROUP * HEAD_DIM, generator=gen) / 24
    norms = {
        "previous (float32)": lambda: previous_value_norms(values, weight),
        "current exact (float32)": lambda: projected_value_norms(values, weight, precision="exact"),
        "current bfloat16": lambda: projected_value_norms(values, weight, precision="bfloat16"),
    }
    rows = [_row("value norms, one layer", name, t, best_ms(fn, repeats, 1)) for name, fn in norms.items()]
    keys = torch.randn(1, H_KV, t, HEAD_DIM, generator=gen)
    kept = int(0.2 * t)
    ragged = torch.zeros(1, H_KV, t, dtype=torch.bool)  # AdaKV-like: three different head budgets
    for h, share in enumerate((0.5, 1.0, 1.5)):
        ragged[0, h, : int(share * kept)] = True
    uniform = torch.zeros(1, H_KV, t, dtype=torch.bool)
    uniform[..., :kept] = True
    tail_k, tail_v = torch.randn(H_KV, 16, HEAD_DIM, generator=gen), torch.randn(H_KV, 16, HEAD_DIM, generator=gen)
    query = torch.randn(H_KV, GROUP, HEAD_DIM, generator=gen)
    full_q = torch.randn(1, H_KV * GROUP, 1, HEAD_DIM, generator=gen)
    for layout, keep in (("uniform 20%", uniform), ("ragged 20%", ragged)):
        tiers = build_prefix(keys, values, keep).tiers
        variants = {
            "previous": lambda tiers=tiers: previous_ragged_attention(query, tiers, tail_k, tail_v, 0.125),
            "current": lambda tiers=tiers: ragged_attention(query, tiers, tail_k, tail_v, None, 0.125),
        }
        rows += [_row(f"decode attention, {layout}", n, t, best_ms(fn, repeats, 50)) for n, fn in variants.items()]

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(full_q, keys, values, scale=0.125, enable_gqa=True)

    rows.append(_row("decode attention, full cache", "sdpa", t, best_ms(sdpa, repeats, 50)))
    return rows


def run(lengths: list[int], repeats: int) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(0)
    return [row for t in lengths for row in one_length(t, repeats, gen)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = run([int(x) for x in args.lengths.split(",")], args.repeats)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"torch {torch.__version__}, {args.threads} threads, best of {args.repeats}")
    print(f"{'kernel':<34} {'variant':<26} {'tokens':>6} {'ms':>9}")
    for r in rows:
        print(f"{r['kernel']:<34} {r['variant']:<26} {r['tokens']:>6} {r['ms']:>9.3f}")


if __name__ == "__main__":
    main()
