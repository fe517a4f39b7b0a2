"""What a prompt's prefill costs in decode steps: the basis of ``criticalkv serve
--offload-prompt-tokens`` (a prompt prefilled on the decode worker holds every row for that long).

    PYTHONPATH=src python benchmarks/prefill_cost.py [--lengths 16,32,64,128,256,512,1024]

For each prompt length, the compressed prefill (the server's method and budget, one request) is
timed best of ``--repeats``; beside it the median of ``--steps`` decode steps of a cache holding a
``--context-tokens`` document at the same budget (what a served row costs per step). Prints one JSON
line per length: prefill ms, ms per prompt token, and the prefill in decode steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from criticalkv import CompressedCache, attach, load_model
from criticalkv.bench.decode import Lockstep, prefill_logits
from criticalkv.bench.prompt import prompt_ids


def served_budget(tokens: int, budget: float, window: int) -> tuple[float, int]:
    """(budget, window) as ``criticalkv serve`` compresses a chat prompt of ``tokens`` tokens at its
    defaults: the window at most the prompt; a prompt too short for ``budget`` is kept whole."""
    window = min(window, tokens)
    return (budget, window) if int(budget * tokens) >= window else (1.0, window)


def timed_prefill(
    model: torch.nn.Module, ids: torch.Tensor, method: str, budget: float, window: int
) -> tuple[float, object]:
    budget, window = served_budget(ids.shape[1], budget, window)
    cache = CompressedCache.for_model(model, method, budget, window=window)
    started = time.perf_counter()
    logits = prefill_logits(model, cache, ids)
    return 1000 * (time.perf_counter() - started), (cache, logits.argmax(-1, keepdim=True))


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16,32,64,128,256,512,1024")
    parser.add_argument("--method", default="critical-adakv")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--window", type=int, default=64, help="the server's default observation window")
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("default")
    attach(model)
    context = prompt_ids(tokenizer, args.context_tokens)
    _, (cache, token) = timed_prefill(model, context, args.method, args.budget, args.window)
    lockstep, steps = Lockstep.after(context), []
    for _ in range(args.steps + 2):
        lockstep.advance()
        started = time.perf_counter()
        logits = lockstep.step(model, cache, token)
        steps.append(1000 * (time.perf_counter() - started))
        token = logits.argmax(-1, keepdim=True)
    step = statistics.median(steps[2:])
    for length in (int(x) for x in args.lengths.split(",") if x):
        ids = prompt_ids(tokenizer, length)
        best = min(timed_prefill(model, ids, args.method, args.budget, args.window)[0] for _ in range(args.repeats))
        whole = served_budget(length, args.budget, args.window)[0] == 1.0
        print(json.dumps({"prompt_tokens": length, "method": args.method, "budget": args.budget,
                          "kept_whole": whole, "prefill_ms": round(best, 2), "ms_per_token": round(best / length, 3),
                          "decode_step_ms": round(step, 2), "context_tokens": args.context_tokens,
                          "prefill_in_decode_steps": round(best / step, 2)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
