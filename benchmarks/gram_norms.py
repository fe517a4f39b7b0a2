"""Selection overhead of CriticalKV's value norms: L1 projection vs the Gram-form exact L2.

Times, per layer, the projected value norms (``projected_value_norms`` p=1 and p=2, float32) and
``gram_value_norms`` on random values with a model's attention shapes (SmolLM2-135M by default:
3 KV heads, 9 query heads, d=64, D=576), and the whole ``Critical`` selection of one layer with
each criterion. Medians over ``--repeats``; run on an idle machine for stable numbers.

    PYTHONPATH=src python benchmarks/gram_norms.py --lengths 4096,8192 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from criticalkv.scores.value_norms import gram_value_norms, projected_value_norms
from criticalkv.scores.window_attention import WindowAttention
from criticalkv.select.critical import Critical
from criticalkv.state import LayerState


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _measure(t: int, module: nn.Module, h_kv: int, g: int, d: int, repeats: int) -> str:
    """One table row at ``t`` tokens."""
    weight = module.o_proj.weight.detach()  # type: ignore[union-attr]
    values = torch.randn(1, h_kv, t, d)
    state = LayerState(
        queries=torch.randn(1, h_kv * g, 32, d),
        keys=torch.randn(1, h_kv, t, d),
        values=values,
        valid=torch.ones(1, t, dtype=torch.bool),
        module=module,
        window=32,
        layer_idx=0,
        num_layers=1,
    )
    scores = WindowAttention()(state).masked_fill(~state.eligible, float("-inf"))
    budgets = torch.full((1, h_kv), t // 5)

    def select(selector: Critical) -> torch.Tensor:
        state.memo.clear()  # the norms are recomputed, as in a fresh prefill
        return selector(scores, budgets, state)

    l1, gram = Critical(precision="exact"), Critical(p=2, gram=True, precision="exact")
    kept_l1 = select(l1)
    overlap = float((kept_l1 & select(gram)).sum() / kept_l1.sum())
    row = [
        _median_ms(lambda: projected_value_norms(values, weight, p=1), repeats),
        _median_ms(lambda: projected_value_norms(values, weight, p=2), repeats),
        _median_ms(lambda: gram_value_norms(values, weight), repeats),
        _median_ms(lambda: select(l1), repeats),
        _median_ms(lambda: select(gram), repeats),
    ]
    return f"{t} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {overlap:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    h_kv, g, d, hidden = args.kv_heads, args.group, args.head_dim, args.hidden
    torch.manual_seed(0)
    module = nn.Module()  # what the selection reads off an attention module: o_proj
    module.o_proj = nn.Linear(h_kv * g * d, hidden, bias=False)
    print(f"threads={torch.get_num_threads()} H_kv={h_kv} G={g} d={d} D={hidden}; per layer, median ms")
    print("T | norms L1 | norms L2 | norms L2-gram | select L1 | select L2-gram | kept overlap L1 vs L2-gram")
    for t in (int(x) for x in args.lengths.split(",")):
        print(_measure(t, module, h_kv, g, d, args.repeats))


if __name__ == "__main__":
    main()
