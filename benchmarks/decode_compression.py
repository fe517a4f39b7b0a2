"""Long generation under a decode budget: memory, decode time and fidelity per position bucket.

The full cache generates greedily (EOS ignored) from a natural-text prompt; every compressed cache
is fed the same tokens in lockstep (teacher forcing on the full cache's own continuation), so at
each step we measure, per cache: the step's wall time, the bytes it holds, and its next-token
distribution against the full cache's (NLL of the full cache's token, its increase over the full
cache's NLL, top-1 agreement, KL(full || compressed)). Writes ``steps.jsonl``, ``summary.json``,
``summary.md`` and ``decode_compression.png`` into ``--out``.

    PYTHONPATH=src python benchmarks/decode_compression.py --out docs/results/decode-compression \
        --prompt-tokens 1024 --new-tokens 1024 --decode-budget 512 --decode-interval 64 \
        --methods adakv critical-adakv

``--kvpress snapkv critical-snapkv`` adds kvpress's ``PrefillDecodingPress`` for those methods (each on
its own plain model copy; needs the ``[bench]`` extra, e.g. ``make test-kvpress``'s ``.venv-kvpress``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch

from criticalkv import attach, load_model
from criticalkv.bench.decode import Lockstep, held_caches, prefill_logits, step_metrics
from criticalkv.bench.figure import plot_steps
from criticalkv.bench.prompt import prompt_ids
from criticalkv.cache import CacheSpec


def buckets(new_tokens: int) -> list[tuple[int, int]]:
    """Position buckets 0-256, 256-512, 512-1K, 1K-2K, 2K-4K, cut at ``new_tokens``."""
    edges = [0, 256, 512, 1024, 2048, 4096]
    return [(a, min(b, new_tokens)) for a, b in itertools.pairwise(edges) if a < new_tokens]


def cache_names(args: argparse.Namespace) -> list[str]:
    """The full cache, ours (``--methods``), then kvpress's (``kvpress:<method>``, ``--kvpress``)."""
    return ["full", *args.methods, *(f"kvpress:{m}" for m in args.kvpress)]


def kvpress_streams(args: argparse.Namespace, prompt_tokens: int) -> dict[str, Any]:
    """One plain model copy per kvpress press (a press hooks every attention module of its model)."""
    if not args.kvpress:
        return {}
    from criticalkv.bench.kvpress_decode import KvpressDecodeStream, kvpress_decode_press
    from criticalkv.bench.kvpress_impl import import_kvpress

    kvpress = import_kvpress()
    if kvpress is None:
        raise SystemExit("--kvpress needs kvpress: pip install 'criticalkv[bench]' (transformers < 5.3)")
    streams = {}
    for method in args.kvpress:
        press = kvpress_decode_press(
            kvpress,
            method,
            prompt_tokens=prompt_tokens,
            prefill_budget=args.prefill_budget,
            window=args.window,
            budget=args.decode_budget,
            interval=args.decode_interval,
        )
        streams[f"kvpress:{method}"] = KvpressDecodeStream(load_model(args.model)[0], press)
    return streams


@torch.no_grad()
def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    attach(model)
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    lockstep = Lockstep.after(ids)
    names = cache_names(args)
    spec = CacheSpec.of(  # the options parsed once; each method takes them (held_caches)
        args.methods[0],
        args.prefill_budget,
        args.window,
        decode_budget=args.decode_budget,
        decode_interval=args.decode_interval,
    )
    caches = held_caches(model, args.methods, spec)
    streams = kvpress_streams(args, args.prompt_tokens)

    def kv_bytes(name: str) -> int:
        return streams[name].kv_bytes() if name in streams else caches[name].kv_bytes()

    logits: dict[str, torch.Tensor] = {}
    for name in names:
        if name in streams:
            logits[name] = streams[name].prefill(ids)
            continue
        logits[name] = prefill_logits(model, caches[name], ids).float()
    records = []
    for step in range(args.new_tokens):
        ref = torch.log_softmax(logits["full"], dim=-1)
        token = int(ref.argmax(-1))
        record: dict[str, Any] = {"position": step, "token": token}
        for name in names:
            record.update({f"{name}/{key}": value for key, value in step_metrics(ref, logits[name], token).items()})
            record[f"{name}/kv_bytes"] = kv_bytes(name)
        lockstep.advance()
        nxt = torch.tensor([[token]])
        for name in names:
            started = time.perf_counter()
            if name in streams:
                logits[name] = streams[name].step(token)
            else:
                logits[name] = lockstep.step(model, caches[name], nxt).float()
            record[f"{name}/ms"] = 1000 * (time.perf_counter() - started)
            record[f"{name}/kv_bytes_after"] = kv_bytes(name)
        records.append(record)
    for name in names:
        if name in streams:
            stream = streams[name]
            stream.close()
            extra = {"peak": stream.peak_bytes, "final": stream.kv_bytes()}
            extra.update(reselections=stream.compressions, reselect_s=stream.compress_seconds)
            records.append({"cache": name, **extra})
            continue
        cache = caches[name]
        decode = cache.decode
        extra = {"peak": cache.kv_bytes_peak(), "final": cache.kv_bytes()}
        if decode is not None:
            extra.update(reselections=decode.reselections, reselect_s=decode.seconds)
        records.append({"cache": name, **extra})
    return records


def summarise(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    steps = [r for r in records if "position" in r]
    finals = {r["cache"]: r for r in records if "cache" in r}
    names = cache_names(args)
    out: dict[str, Any] = {"config": vars(args), "buckets": [], "caches": {}}
    for lo, hi in buckets(len(steps)):
        chunk = steps[lo:hi]
        row: dict[str, Any] = {"bucket": f"{lo}-{hi}"}
        for name in names:
            nll = sum(r[f"{name}/nll"] for r in chunk) / len(chunk)
            full_nll = sum(r["full/nll"] for r in chunk) / len(chunk)
            row[name] = {
                "kv_mib_max": max(max(r[f"{name}/kv_bytes"], r[f"{name}/kv_bytes_after"]) for r in chunk) / 2**20,
                "ms_per_token": sorted(r[f"{name}/ms"] for r in chunk)[len(chunk) // 2],  # median
                "nll_increase": nll - full_nll,
                "top1": sum(r[f"{name}/top1"] for r in chunk) / len(chunk),
                "kl": sum(r[f"{name}/kl"] for r in chunk) / len(chunk),
            }
        out["buckets"].append(row)
    for name in names:
        total_ms = sum(r[f"{name}/ms"] for r in steps)
        info = dict(finals[name])
        info["decode_s"] = total_ms / 1000
        if "reselect_s" in info:
            info["reselect_share"] = info["reselect_s"] / info["decode_s"]
        out["caches"][name] = info
    return out


def markdown(summary: dict[str, Any], names: list[str]) -> str:
    lines = ["| bucket | cache | KV MiB (max) | ms/token (median) | NLL increase | top-1 | KL |", "|---" * 7 + "|"]
    for row in summary["buckets"]:
        for name in names:
            m = row[name]
            lines.append(
                f"| {row['bucket']} | {name} | {m['kv_mib_max']:.2f} | {m['ms_per_token']:.1f} | "
                f"{m['nll_increase']:+.4f} | {m['top1']:.3f} | {m['kl']:.4f} |"
            )
    lines += ["", "| cache | peak KV MiB | final KV MiB | decode s | re-selections | re-selection s (share) |"]
    lines.append("|---" * 6 + "|")
    for name in names:
        c = summary["caches"][name]
        share = f"{c['reselect_s']:.2f} ({100 * c['reselect_share']:.1f}%)" if "reselect_s" in c else "-"
        lines.append(
            f"| {name} | {c['peak'] / 2**20:.2f} | {c['final'] / 2**20:.2f} | {c['decode_s']:.1f} | "
            f"{c.get('reselections', '-')} | {share} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], names: list[str], path: Path, smooth: int = 32) -> None:
    steps = [r for r in records if "position" in r]
    plot_steps(steps, names, path, smooth=smooth, bytes_key="kv_bytes_after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--methods", nargs="+", default=["adakv", "critical-adakv"])
    parser.add_argument(
        "--kvpress",
        nargs="*",
        default=[],
        help="also run kvpress's PrefillDecodingPress for these methods (snapkv, critical-snapkv, knorm, streamingllm)",
    )
    parser.add_argument("--prefill-budget", type=int, default=512, help="entries per head kept of the prompt")
    parser.add_argument("--decode-budget", type=int, default=512)
    parser.add_argument("--decode-interval", type=int, default=64)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: tiny decode ops on a shared CPU)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    records = run(args)
    with (args.out / "steps.jsonl").open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    summary = summarise(records, args)
    args.out = str(args.out)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    names = cache_names(args)
    (Path(args.out) / "summary.md").write_text(markdown(summary, names))
    plot(records, names, Path(args.out) / "decode_compression.png")
    print(markdown(summary, names))


if __name__ == "__main__":
    main()
