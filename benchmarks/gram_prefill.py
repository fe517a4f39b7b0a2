"""CriticalKV's L1 criterion vs the Gram-form L2 on a real model: selection overhead and kept sets.

``overhead`` (per context length, natural-text prompt as ``criticalkv bench`` uses, batch 1):

1. each base method's time to first token (TTFT) with compression in flight through the
   physically compressed cache, best of ``--prefills``;
2. the prefill captured once; then, interleaved in rounds (every method once per round, value
   norms and window attention recomputed each time), every method's selection over all layers
   (scores, budgets, selection: ``Method.keep_mask``), best of ``--repeats``.

It reports each Critical variant's extra selection time over its base (the same scores and
budgets; only the selection differs) as a share of the base's TTFT, the definition of
docs/results/claims.md's TTFT row.

``overlap`` (RULER prompts, question-aware, every layer): per layer and head, the kept entries of
the L1 selection and of the Gram-form L2 selection (same budgets: the budgets depend on the scores
only), as overlap ``|A & B| / |A|``, Jaccard ``|A & B| / |A | B|`` and the overlap of the stage-2
entries alone (the window and stage 1 are chosen by attention and are the same in both).

    PYTHONPATH=src python benchmarks/gram_prefill.py overhead --lengths 4096,8128 --out docs/results/gram-norms
    PYTHONPATH=src python benchmarks/gram_prefill.py overlap --lengths 1024,4096 --out docs/results/gram-norms
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from criticalkv.bench.prompt import bench_prompts
from criticalkv.budgets.resolve import resolve_budget
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.eval.sample import encode_sample
from criticalkv.eval.tasks import make_sample
from criticalkv.methods import Method, bind, get_method
from criticalkv.models import load_model
from criticalkv.runtime import attach
from criticalkv.runtime.forward import capture_prefill, prefill_into
from criticalkv.select.critical import Critical
from criticalkv.select.topk import topk_mask
from criticalkv.state import LayerState

WINDOW = 32
GRAM = {"p": 2, "gram": True}
#: base -> its Critical variants (label, registered name, options)
VARIANTS: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "adakv": [("L1", "critical-adakv", {}), ("L2-gram", "critical-adakv", GRAM)],
    "snapkv": [("L1", "critical-snapkv", {}), ("L2-gram", "critical-snapkv", GRAM)],
}
Clock = Callable[[], float]
#: ``wall``: elapsed seconds; ``cpu``: the process's CPU seconds (with one thread, the work done,
#: much less sensitive than wall time to other jobs on a loaded machine)
CLOCKS: dict[str, Clock] = {"wall": time.perf_counter, "cpu": time.process_time}
OVERLAP_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_multikey_1",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)


def _methods(model: Any, bases: list[str]) -> dict[str, Method]:
    """``label -> bound method`` for each base and its Critical variants (``adakv``, ``adakv/L1``, ...)."""
    found: dict[str, Method] = {}
    for base in bases:
        found[base] = bind(get_method(base), model)
        for label, name, options in VARIANTS[base]:
            found[f"{base}/{label}"] = bind(get_method(name, **options), model)
    return found


@torch.no_grad()
def _ttft(model: Any, ids: torch.Tensor, method: Method, budget: float, clock: Clock) -> tuple[float, float]:
    """(TTFT on ``clock``, compression wall seconds) of one prefill with compression in flight."""
    cache = CompressedCache.for_model(model, method, budget, window=WINDOW)
    cache.synchronize_timing = True
    start = clock()
    prefill_into(model, cache, ids, torch.ones_like(ids))
    return clock() - start, cache.compress_seconds


@torch.no_grad()
def _selection_seconds(method: Method, states: list[LayerState], budget: torch.Tensor, clock: Clock) -> float:
    """Seconds for ``method.keep_mask`` over every layer, derived tensors recomputed."""
    for state in states:
        state.memo.clear()
    start = clock()
    for state in states:
        method.keep_mask(state, budget)
    return clock() - start


@torch.no_grad()
def _norm_seconds(method: Method, states: list[LayerState], clock: Clock) -> float:
    """Seconds for the Critical selection's value norms alone over every layer, recomputed."""
    selection = cast(Critical, method.select)
    for state in states:
        state.memo.clear()
    start = clock()
    for state in states:
        selection.norms(state)
    return clock() - start


def overhead(model: Any, tokenizer: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    attach(model)
    methods = _methods(model, args.bases)
    clock = CLOCKS[args.clock]
    rows: list[dict[str, Any]] = []
    for length in args.lengths:
        ids = bench_prompts(tokenizer, length, 1)
        start = clock()
        states, _ = capture_prefill(model, ids, torch.ones_like(ids), window=WINDOW)
        capture_s = clock() - start
        budget = resolve_budget(args.budget, states[0].lengths, WINDOW)
        ttfts: dict[str, list[float]] = {base: [] for base in args.bases}
        inflight: dict[str, list[float]] = {base: [] for base in args.bases}
        times: dict[str, list[float]] = {label: [] for label in methods}
        norms: dict[str, list[float]] = {label: [] for label in methods if label.endswith("/L2-gram")}
        _selection_seconds(methods[f"{args.bases[0]}/L2-gram"], states, budget, clock)  # warm up
        for round_ in range(max(args.repeats, args.prefills)):
            for base in args.bases if round_ < args.prefills else []:
                ttft, compress = _ttft(model, ids, methods[base], args.budget, clock)
                ttfts[base].append(ttft)
                inflight[base].append(compress)
            for label, method in methods.items() if round_ < args.repeats else []:
                times[label].append(_selection_seconds(method, states, budget, clock))
                if label in norms:
                    norms[label].append(_norm_seconds(method, states, clock))
        del states
        for base in args.bases:
            base_ttft, base_select = min(ttfts[base]), min(times[base])
            for label, _, _ in VARIANTS[base]:
                mine = min(times[f"{base}/{label}"])
                row = {
                    "length": length,
                    "base": base,
                    "variant": label,
                    "base_ttft_s": base_ttft,
                    "base_ttft_all_s": ttfts[base],
                    "capture_prefill_s": capture_s,
                    "base_compress_in_flight_s": min(inflight[base]),
                    "base_select_s": base_select,
                    "variant_select_s": mine,
                    "base_select_all_s": times[base],
                    "variant_select_all_s": times[f"{base}/{label}"],
                    "extra_s": mine - base_select,
                    "extra_paired_median_s": statistics.median(
                        a - b for a, b in zip(times[f"{base}/{label}"], times[base], strict=True)
                    ),
                    "variant_norms_s": min(norms.get(f"{base}/{label}", [float("nan")])),
                    "extra_share_of_base_ttft": (mine - base_select) / base_ttft,
                    "threads": torch.get_num_threads(),
                    "clock": args.clock,
                }
                rows.append(row)
                print(
                    f"T={length} {base}+{label}: base TTFT {base_ttft:.2f} s, selection {base_select:.3f} s -> "
                    f"{mine:.3f} s (norms alone {row['variant_norms_s']:.3f} s), extra {row['extra_s']:.3f} s = "
                    f"{row['extra_share_of_base_ttft']:+.2%} of TTFT",
                    flush=True,
                )
    return rows


def _stage2(method: Method, state: LayerState, budget: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Stage-2 entries of a Critical selection: kept, outside the window, not chosen in stage 1."""
    scores = method.ranked_scores(state, budget)
    budgets = method.budgets(scores, state, budget)
    alpha = cast(Critical, method.select).alpha
    k1 = torch.clamp(torch.floor(alpha * budgets.double()).long() - state.window, min=0)
    stage1 = topk_mask(scores, k1, state.eligible)
    return keep & state.eligible & ~stage1


@torch.no_grad()
def overlap(model: Any, tokenizer: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per prompt, layer and base: the overlap rows; each prompt's are appended to ``overlap.jsonl``
    when done, and a rerun skips the (length, task) pairs already there."""
    path = args.out / "overlap.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    finished = {(r["length"], r["task"]) for r in map(json.loads, filter(None, lines))}
    rows: list[dict[str, Any]] = []
    for length in args.lengths:
        for task in OVERLAP_TASKS[: args.prompts]:
            if (length, task) in finished:
                continue
            done = len(rows)
            sample = make_sample(task, tokenizer, length, 0)
            context, question = encode_sample(tokenizer, sample)
            ids = torch.tensor([context + question])
            states, _ = capture_prefill(model, ids, torch.ones_like(ids), window=WINDOW)
            budget = resolve_budget(args.budget, states[0].lengths, WINDOW)
            for base in args.bases:
                (_, l1_name, l1_opts), (_, gram_name, gram_opts) = VARIANTS[base]
                l1 = bind(get_method(l1_name, **l1_opts), model)
                gram = bind(get_method(gram_name, **gram_opts), model)
                for state in states:
                    a, b = l1.keep_mask(state, budget), gram.keep_mask(state, budget)
                    a2, b2 = _stage2(l1, state, budget, a), _stage2(gram, state, budget, b)
                    both = (a & b).sum(-1).double()
                    rows.append(
                        {
                            "length": length,
                            "tokens": int(ids.shape[1]),
                            "task": task,
                            "base": base,
                            "layer": state.layer_idx,
                            "overlap": (both / a.sum(-1)).flatten().tolist(),
                            "jaccard": (both / (a | b).sum(-1)).flatten().tolist(),
                            "stage2_overlap": ((a2 & b2).sum(-1) / a2.sum(-1).clamp_min(1)).flatten().tolist(),
                            "same_size": bool(torch.equal(a.sum(-1), b.sum(-1))),
                        }
                    )
            _append(path, rows[done:])
            print(f"T={length} {task}: {ids.shape[1]} tokens done", flush=True)
    return rows


def _append(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def overlap_table(rows: list[dict[str, Any]]) -> str:
    """Per (length, base, layer): mean and min over prompts and heads of each overlap."""
    head = ["length", "base", "layer", "overlap mean", "overlap min", "jaccard mean", "jaccard min"]
    lines = [" | ".join([*head, "stage-2 mean", "stage-2 min"])]
    keys = sorted({(r["length"], r["base"], r["layer"]) for r in rows})
    for length, base, layer in keys:
        mine = [r for r in rows if (r["length"], r["base"], r["layer"]) == (length, base, layer)]
        cells = [length, base, layer]
        for field in ("overlap", "jaccard", "stage2_overlap"):
            values = [v for r in mine for v in r[field]]
            cells += [f"{statistics.fmean(values):.4f}", f"{min(values):.4f}"]
        lines.append(" | ".join(str(c) for c in cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["overhead", "overlap"])
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8128])
    parser.add_argument("--bases", type=lambda s: s.split(","), default=["adakv", "snapkv"])
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--prefills", type=int, default=2, help="base TTFT: best of this many prefills")
    parser.add_argument("--repeats", type=int, default=5, help="selection: best of this many interleaved rounds")
    parser.add_argument("--prompts", type=int, default=8, help="overlap: RULER prompts per length (one per task)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="overhead: what the times are")
    parser.add_argument("--out", type=Path, default=Path("gram-out"))
    args = parser.parse_args()
    unknown = sorted(set(args.bases) - set(VARIANTS))
    if unknown:
        parser.error(f"--bases: {', '.join(unknown)} not among {', '.join(VARIANTS)}")
    model, tokenizer = load_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "overhead":
        name = "overhead.jsonl" if args.clock == "wall" else f"overhead-{args.clock}.jsonl"
        _append(args.out / name, overhead(model, tokenizer, args))
        return
    overlap(model, tokenizer, args)
    lines = (args.out / "overlap.jsonl").read_text(encoding="utf-8").splitlines()
    table = overlap_table([json.loads(line) for line in lines if line.strip()])
    (args.out / "overlap-table.txt").write_text(table + "\n", encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
