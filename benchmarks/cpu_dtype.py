"""bfloat16 against float32 on this CPU, for the default model: fidelity and speed.

Fidelity (needle retrieval, question-aware, the gold 7-digit answer teacher-forced): for the
full cache and each method at ``--budget``, the gold answer's mean NLL in each dtype and the
paired bf16 - float32 difference with a 95% bootstrap interval; top-1 agreement of each dtype's
predictions with float32's full cache; the kept sets' overlap (bf16's kept entries that float32
keeps too, per layer and KV head). Speed, paired and interleaved (the order alternates): one
prefill that captures the states, and greedy decode steps on the full cache.

    python benchmarks/cpu_dtype.py --samples 16 --out docs/results/cpu-dtype

Writes ``rows.jsonl`` (one line per sample, dtype and method), ``timing.jsonl`` and ``summary.md``.
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

from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.eval.demo import DEMO_METHODS
from criticalkv.eval.tasks import make_needle_sample
from criticalkv.models import load_model
from criticalkv.prompts import encode_pair
from criticalkv.runtime import continue_generation, prefill, teacher_forced_logprobs

DTYPES = ("float32", "bfloat16")


def overlap(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Share of ``ours``' kept entries that ``reference`` keeps too, over every layer and head."""
    both = sum(int((a & b).sum()) for a, b in zip(ours, reference, strict=True))
    kept = sum(int(a.sum()) for a in ours)
    return both / max(kept, 1)


@torch.no_grad()
def sample_rows(models: dict[str, Any], tokenizer: Any, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """Every (dtype, method) outcome on one needle sample."""
    sample = make_needle_sample(tokenizer, args.length, seed=seed)
    ctx, qst = encode_pair(tokenizer, sample.context, sample.question)
    gold = list(tokenizer(sample.answer, add_special_tokens=False)["input_ids"])
    ids = torch.tensor([ctx + qst])
    mask = torch.ones_like(ids)
    rows, masks, reference = [], {}, None
    for dtype in DTYPES:
        states, first = prefill(models[dtype], ids, mask, window=args.window)
        for method in args.methods:
            budget = 1.0 if method == "full" else args.budget
            cache = CompressedCache.from_states(states, method, budget)
            masks[dtype, method] = [m.cpu() for m in cache.keep_masks()]
            logprobs = teacher_forced_logprobs(models[dtype], cache, mask, gold, len(gold), first)[0]
            target = torch.tensor(gold)
            predicted = logprobs.argmax(-1)
            if reference is None:  # float32, full cache: the first configuration
                reference = predicted
            rows.append(
                {
                    "sample": seed,
                    "dtype": dtype,
                    "method": method,
                    "budget": budget,
                    "tokens": len(ctx) + len(qst),
                    "nll": float(-logprobs.gather(1, target[:, None]).mean()),
                    "top1_vs_fp32_full": float((predicted == reference).float().mean()),
                    "exact_first_token": bool(predicted[0] == target[0]),
                }
            )
        del states
    for row in rows:
        if row["dtype"] == "bfloat16":
            row["kept_overlap_vs_fp32"] = overlap(masks["bfloat16", row["method"]], masks["float32", row["method"]])
    return rows


@torch.no_grad()
def timing_rows(models: dict[str, Any], tokenizer: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Prefill (with capture) and greedy decode on the full cache, each dtype in turn, the order alternating."""
    sample = make_needle_sample(tokenizer, args.timing_length, seed=10_000)
    ctx, qst = encode_pair(tokenizer, sample.context, sample.question)
    ids = torch.tensor([ctx + qst])
    mask = torch.ones_like(ids)
    out = []
    for repeat in range(args.timing_repeats):
        order = DTYPES if repeat % 2 == 0 else DTYPES[::-1]
        for dtype in order:
            model = models[dtype]
            start = time.perf_counter()
            states, first = prefill(model, ids, mask, window=args.window)
            prefilled = time.perf_counter()
            cache = CompressedCache.from_states(states, "full", 1.0)
            del states
            decode_start = time.perf_counter()
            new = continue_generation(model, cache, ids, mask, first.argmax(-1), args.decode_tokens)
            decoded = time.perf_counter()
            out.append(
                {
                    "repeat": repeat,
                    "dtype": dtype,
                    "tokens": int(ids.shape[1]),
                    "prefill_s": prefilled - start,
                    "decode_ms_per_token": 1000 * (decoded - decode_start) / max(int(new.shape[1]), 1),
                    "load_1min": os.getloadavg()[0],
                }
            )
            print(json.dumps(out[-1]), flush=True)
    return out


def paired_interval(diffs: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``diffs`` and its 95% percentile-bootstrap interval."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(draws))
    return statistics.fmean(diffs), means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def summary(rows: list[dict[str, Any]], timing: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown tables: fidelity per method, then speed per dtype."""
    if not rows:
        return ""
    lines = [
        f"{args.samples} needle samples of ~{args.length} tokens, budget {args.budget}, window {args.window}.",
        "",
        "| method | NLL fp32 | NLL bf16 | bf16 - fp32 [95% CI] | top-1 vs fp32 full: fp32 / bf16 | kept overlap |",
        "|---|---|---|---|---|---|",
    ]
    for method in args.methods:
        by = {d: [r for r in rows if r["method"] == method and r["dtype"] == d] for d in DTYPES}
        diffs = [b["nll"] - f["nll"] for f, b in zip(by["float32"], by["bfloat16"], strict=True)]
        mean, low, high = paired_interval(diffs)
        nll = {d: statistics.fmean(r["nll"] for r in by[d]) for d in DTYPES}
        top1 = {d: statistics.fmean(r["top1_vs_fp32_full"] for r in by[d]) for d in DTYPES}
        kept = statistics.fmean(r["kept_overlap_vs_fp32"] for r in by["bfloat16"])
        lines.append(
            f"| {method} | {nll['float32']:.4f} | {nll['bfloat16']:.4f} | {mean:+.4f} [{low:+.4f}, {high:+.4f}] "
            f"| {top1['float32']:.3f} / {top1['bfloat16']:.3f} | {kept:.4f} |"
        )
    if not timing:
        return "\n".join(lines) + "\n"
    lines += ["", "| dtype | prefill s (best, median) | decode ms/token (best, median) |", "|---|---|---|"]
    for dtype in DTYPES:
        mine = [t for t in timing if t["dtype"] == dtype]
        pre = sorted(t["prefill_s"] for t in mine)
        dec = sorted(t["decode_ms_per_token"] for t in mine)
        lines.append(
            f"| {dtype} | {pre[0]:.2f}, {statistics.median(pre):.2f} | {dec[0]:.1f}, {statistics.median(dec):.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--methods", default=",".join(DEMO_METHODS))
    parser.add_argument("--timing-length", type=int, default=4000)
    parser.add_argument("--timing-repeats", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    args.out.mkdir(parents=True, exist_ok=True)
    models = {}
    for dtype in DTYPES:
        models[dtype], tokenizer = load_model(dtype=dtype)
    timing = timing_rows(models, tokenizer, args) if args.timing_repeats > 0 else []
    rows: list[dict[str, Any]] = []
    for seed in range(args.samples):
        rows += sample_rows(models, tokenizer, args, seed)
        print(f"sample {seed} done", flush=True)
    (args.out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (args.out / "timing.jsonl").write_text("".join(json.dumps(t) + "\n" for t in timing))
    capability = torch.backends.cpu.get_cpu_capability()
    meta = f"torch {torch.__version__}, CPU capability {capability}, threads {torch.get_num_threads()}"
    text = summary(rows, timing, args)
    (args.out / "summary.md").write_text(meta + "\n\n" + text)
    print(meta)
    print(text)


if __name__ == "__main__":
    main()
