"""Memory held while a prompt is compressed: peak RSS and the most KV bytes the cache held.

    PYTHONPATH=src python benchmarks/prompt_memory.py \
        [--methods full,snapkv,defensivekv,layer-defensivekv] [--lengths 2048,4096,6800] [--budget 0.2]

Each (method, length) runs in a fresh process (peak RSS, ``ru_maxrss``, is per process): load the
default model, prefill the first ``length`` tokens of the natural-text haystack into a
:class:`~criticalkv.CompressedCache` at ``--budget``, one forward call (as ``generate`` does). Prints
one JSON line per run: peak RSS, the RSS after loading the model (so the prefill's share is the
difference), ``prefill_peak_bytes`` (the most KV bytes the cache held during the prefill, the
layer being compressed included; ``null`` on versions without it) and the KV bytes held after.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch


def one(method: str, tokens: int, budget: float, threads: int) -> dict[str, object]:
    """Measure one (method, length) in this process."""
    from criticalkv import CompressedCache, attach, load_model
    from criticalkv.bench.decode import prefill_logits
    from criticalkv.bench.prompt import prompt_ids

    torch.set_num_threads(threads)
    model, tokenizer = load_model("default")
    attach(model)
    ids = prompt_ids(tokenizer, tokens)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cache = CompressedCache.for_model(model, method, budget if method != "full" else 1.0)
    with torch.no_grad():
        prefill_logits(model, cache, ids)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    full_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * tokens * head_dim * element
    return {
        "method": method,
        "tokens": tokens,
        "budget": budget if method != "full" else 1.0,
        "peak_rss_mb": round(peak / 1024, 1),
        "loaded_rss_mb": round(loaded / 1024, 1),
        "prefill_peak_kv_mb": _mb(getattr(cache, "prefill_peak_bytes", None)),
        "kv_after_mb": _mb(cache.kv_bytes()),
        "full_kv_mb": _mb(full_bytes),
    }


def _mb(n: int | None) -> float | None:
    return None if n is None else round(n / 2**20, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="full,snapkv,defensivekv,layer-defensivekv")
    parser.add_argument("--lengths", default="2048,4096,6800")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.budget, args.threads)), flush=True)
        return
    for tokens in [int(x) for x in args.lengths.split(",")]:
        for method in args.methods.split(","):
            command = [sys.executable, __file__, "--one", method, str(tokens), "--budget", str(args.budget)]
            command += ["--threads", str(args.threads)]
            subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
