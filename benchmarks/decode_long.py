"""The issue's long generation: a 1K-token prompt, 4096 generated tokens, decode budget 512, interval 64.

The full cache generates greedily (EOS ignored); each method's cache is fed the same tokens in
lockstep (teacher forcing on the full cache's own continuation), one step of every cache after the
other, so load swings of a shared machine hit all caches alike. Per step and cache it records the
wall time of the decode forward, the re-selection seconds spent inside it, the bytes held (tail
capacity included) and the fidelity against the full cache (NLL of the full cache's token, top-1
agreement, KL(full || compressed)). Records are written to ``steps.jsonl`` as they are made (a run
stopped early leaves every finished step), and ``--summarise`` turns a folder into
``summary.json``, ``summary.md`` and ``decode_long.png``. Several processes may share the work: each
runs the full cache beside its own ``--methods`` into its own ``--out``; ``--summarise`` takes the
folders together (the full cache's timings from the first).

    PYTHONPATH=src python benchmarks/decode_long.py --out runs/long-ada --methods adakv critical-adakv
    PYTHONPATH=src python benchmarks/decode_long.py --summarise runs/long-ada runs/long-snap \
        --write docs/results/decode-compression/long
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from criticalkv import attach, load_model
from criticalkv.bench.decode import Lockstep, held_caches, prefill_logits, step_metrics
from criticalkv.bench.figure import plot_steps
from criticalkv.bench.prompt import prompt_ids
from criticalkv.cache import CacheSpec

#: the issue's position buckets (generated tokens)
EDGES = (0, 512, 1024, 2048, 4096)
#: the generated positions whose decode speed the issue compares, and the half-width of the window
#: of steps whose timings are pooled around each
COMPARE = (500, 4000)
HALF = 64


@torch.no_grad()
def run(args: argparse.Namespace) -> None:
    """Generate ``args.new_tokens`` in lockstep, appending one line per step to ``steps.jsonl``."""
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    attach(model)
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    lockstep = Lockstep.after(ids)
    spec = CacheSpec.of(  # the options parsed once; each method takes them (held_caches)
        args.methods[0],
        args.prefill_budget,
        args.window,
        decode_budget=args.decode_budget,
        decode_interval=args.decode_interval,
    )
    caches = held_caches(model, args.methods, spec)
    logits = {name: prefill_logits(model, cache, ids).float() for name, cache in caches.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}, indent=1))
    with (args.out / "steps.jsonl").open("w") as f:
        for step in range(args.new_tokens):
            ref = torch.log_softmax(logits["full"], dim=-1)
            token = int(ref.argmax(-1))
            record: dict[str, Any] = {"position": step, "token": token}
            for name in caches:
                for key, value in step_metrics(ref, logits[name], token).items():
                    record[f"{name}/{key}"] = value
            lockstep.advance()
            nxt = torch.tensor([[token]])
            for name, cache in caches.items():
                before = 0.0 if cache.decode is None else cache.decode.seconds
                started = time.perf_counter()
                step_logits = lockstep.step(model, cache, nxt)
                record[f"{name}/ms"] = 1000 * (time.perf_counter() - started)
                record[f"{name}/reselect_ms"] = 0.0 if cache.decode is None else 1000 * (cache.decode.seconds - before)
                record[f"{name}/kv_bytes"] = cache.kv_bytes()
                record[f"{name}/kv_bytes_peak"] = cache.kv_bytes_peak()
                logits[name] = step_logits.float()
            f.write(json.dumps(record) + "\n")
            f.flush()


def load_steps(folders: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """The steps of every folder merged by position (cut to the shortest), and the cache names."""
    runs = [[json.loads(line) for line in (folder / "steps.jsonl").open()] for folder in folders]
    n = min(len(r) for r in runs)
    names = ["full"]
    merged = [dict(r) for r in runs[0][:n]]
    for other in runs[1:]:
        for mine, theirs in zip(merged, other[:n], strict=True):
            if mine["token"] != theirs["token"]:
                raise ValueError(f"the full caches of the folders disagree at position {mine['position']}")
            mine.update({k: v for k, v in theirs.items() if not k.startswith("full/")})
            # each cache's step against the full cache's step of its own process (same moment, same load)
            timed = [k[: -len("/ms")] for k in theirs if k.endswith("/ms") and not k.startswith("full/")]
            mine.update({f"{name}/full_ms": theirs["full/ms"] for name in timed})
    for key in merged[0] if merged else []:
        name = key.split("/")[0]
        if "/" in key and name not in names:
            names.append(name)
    return merged, names


def timing(values: list[float]) -> dict[str, float]:
    """Median and 10th percentile (a best-of estimate robust to a loaded machine) of step times."""
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p10": ordered[len(ordered) // 10]}


def summarise(steps: list[dict[str, Any]], names: list[str], entry_bytes: int) -> dict[str, Any]:
    """Per bucket and cache: bytes, ms/token, fidelity; per cache: the speed and memory targets."""
    out: dict[str, Any] = {"steps": len(steps), "buckets": [], "caches": {}}
    for lo, hi in itertools.pairwise(EDGES):
        chunk = steps[lo:hi]
        if not chunk:
            break
        row: dict[str, Any] = {"bucket": f"{lo}-{lo + len(chunk)}"}
        full_nll = statistics.fmean(r["full/nll"] for r in chunk)
        for name in names:
            row[name] = {
                "kv_mib_max": max(r[f"{name}/kv_bytes_peak"] for r in chunk) / 2**20,
                "ms": timing([r[f"{name}/ms"] for r in chunk]),
                "over_full": statistics.median(r[f"{name}/ms"] / r.get(f"{name}/full_ms", r["full/ms"]) for r in chunk),
                "nll_increase": statistics.fmean(r[f"{name}/nll"] for r in chunk) - full_nll,
                "top1": statistics.fmean(r[f"{name}/top1"] for r in chunk),
                "kl": statistics.fmean(r[f"{name}/kl"] for r in chunk),
            }
        out["buckets"].append(row)
    for name in names:
        total = sum(r[f"{name}/ms"] for r in steps)
        info: dict[str, Any] = {
            "decode_s": total / 1000,
            "reselect_share": sum(r[f"{name}/reselect_ms"] for r in steps) / total,
            "peak_entries_per_head": max(r[f"{name}/kv_bytes_peak"] for r in steps) / entry_bytes,
            "nll_increase": statistics.fmean(r[f"{name}/nll"] - r["full/nll"] for r in steps),
        }
        for at in COMPARE:
            window = steps[max(0, at - HALF) : at + HALF]
            if len(window) == 2 * HALF:
                info[f"step{at}"] = timing([r[f"{name}/ms"] for r in window])
        if all(f"step{at}" in info for at in COMPARE):
            late, early = (info[f"step{at}"] for at in reversed(COMPARE))
            info["late_over_early"] = {k: late[k] / early[k] for k in ("median", "p10")}
        if "step500" in info and len(steps) >= COMPARE[0] + 3 * HALF:  # a run stopped early: its last steps
            info["last_steps"] = [len(steps) - 2 * HALF, len(steps)]
            last = timing([r[f"{name}/ms"] for r in steps[-2 * HALF :]])
            info["last_over_step500"] = {k: last[k] / info["step500"][k] for k in ("median", "p10")}
        out["caches"][name] = info
    return out


def markdown(summary: dict[str, Any], names: list[str]) -> str:
    """The bucket table and the per-cache target table."""
    lines = [
        "| bucket | cache | KV MiB (max) | ms/token median (p10) | ms / full's | NLL increase | top-1 | KL |",
        "|---" * 8 + "|",
    ]
    for row in summary["buckets"]:
        for name in names:
            m = row[name]
            lines.append(
                f"| {row['bucket']} | {name} | {m['kv_mib_max']:.2f} | {m['ms']['median']:.1f} ({m['ms']['p10']:.1f}) "
                f"| {m['over_full']:.3f} | {m['nll_increase']:+.4f} | {m['top1']:.3f} | {m['kl']:.4f} |"
            )
    lines += [
        "",
        "| cache | peak entries/head | decode s | re-selection share | step 500 ms median (p10) "
        "| step 4000 ms median (p10) | 4000/500 median (p10) |",
        "|---" * 7 + "|",
    ]
    for name in names:
        c = summary["caches"][name]

        def at(key: str, c: dict[str, Any] = c) -> str:
            return f"{c[key]['median']:.1f} ({c[key]['p10']:.1f})" if key in c else "-"

        ratio = c.get("late_over_early") or c.get("last_over_step500")
        ratio_s = f"{ratio['median']:.3f} ({ratio['p10']:.3f})" if ratio else "-"
        if "late_over_early" not in c and ratio:
            ratio_s += " (steps {}-{} / 500)".format(*c["last_steps"])
        lines.append(
            f"| {name} | {c['peak_entries_per_head']:.1f} | {c['decode_s']:.1f} | {100 * c['reselect_share']:.2f}% "
            f"| {at('step500')} | {at('step4000')} | {ratio_s} |"
        )
    return "\n".join(lines) + "\n"


def plot(steps: list[dict[str, Any]], names: list[str], path: Path, smooth: int = 64) -> None:
    """ms/token (rolling median) and KV MiB against the generated position, one line per cache."""
    label = "KV cache MiB (tail capacity included)"
    plot_steps(steps, names, path, smooth=smooth, bytes_key="kv_bytes", bytes_label=label, linewidth=0.9)


def write_summary(folders: list[Path], dest: Path, entry_bytes: int) -> None:
    steps, names = load_steps(folders)
    summary = summarise(steps, names, entry_bytes)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.json").write_text(json.dumps(summary, indent=1))
    (dest / "summary.md").write_text(markdown(summary, names))
    plot(steps, names, dest / "decode_long.png")
    print(markdown(summary, names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for steps.jsonl (a run)")
    parser.add_argument("--summarise", type=Path, nargs="+", help="run folders to summarise together")
    parser.add_argument("--write", type=Path, help="where --summarise writes (default: the first folder)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=4096)
    parser.add_argument("--methods", nargs="+", default=["adakv", "critical-adakv"])
    parser.add_argument("--prefill-budget", type=int, default=512, help="entries per head kept of the prompt")
    parser.add_argument("--decode-budget", type=int, default=512)
    parser.add_argument("--decode-interval", type=int, default=64)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: tiny decode ops on a shared CPU)")
    parser.add_argument(
        "--entry-bytes", type=int, default=30 * 3 * 2 * 64 * 4, help="bytes of one entry per head in all layers"
    )
    args = parser.parse_args()
    if args.summarise:
        write_summary(args.summarise, args.write or args.summarise[0], args.entry_bytes)
    elif args.out is None:
        parser.error("give --out (a run) or --summarise (folders)")
    else:
        run(args)


if __name__ == "__main__":
    main()
