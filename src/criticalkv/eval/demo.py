"""``make demo``: a needle-retrieval comparison of methods on the default model."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from criticalkv.budgets.resolve import Budget
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.eval.tasks.needle import digit_credit, exact_match, make_needle_sample
from criticalkv.plotting import category_axis, dodged, method_style, pyplot, wrapped
from criticalkv.prompts import encode_pair, left_pad
from criticalkv.runtime import check_positions, continue_generation, decode_answers, eos_ids, input_device, prefill

logger = logging.getLogger(__name__)

#: full, the paper's bases and their Critical variants, and the authors' follow-up (DefensiveKV, both forms)
DEMO_METHODS = (
    "full",
    "snapkv",
    "critical-snapkv",
    "adakv",
    "critical-adakv",
    "defensivekv",
    "layer-defensivekv",
)


@dataclass
class DemoRow:
    """One (sample, method, budget) outcome."""

    sample: int
    method: str
    budget: Budget
    exact: float
    digits: float
    answer: str
    target: str
    kv_bytes: int
    kv_bytes_full: int
    compress_s: float
    decode_s: float
    new_tokens: int


@torch.no_grad()
def run_demo(
    model: Any,
    tokenizer: Any,
    *,
    methods: Sequence[str] = DEMO_METHODS,
    budgets: Sequence[Budget] = (0.1, 0.2),
    samples: int = 8,
    length: int = 2048,
    window: int = 16,
    max_new_tokens: int = 32,
    seed: int = 0,
) -> list[DemoRow]:
    """Needle retrieval (question-aware) for each method and budget; one prefill per sample.

    The window defaults to 16 tokens, about the question's length: on the default model a
    window that holds just the question works far better than 32 or 64 (docs/results/demo-default.md).
    A ``length`` beyond the model's positions is refused before any sample is made.
    """
    fix = "lower --length"
    check_positions(model, length, max_new_tokens, what=f"a needle context of --length {length}", fix=fix)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = input_device(model)
    eos = eos_ids(model, tokenizer)
    configs = [("full", 1.0)] if "full" in methods else []
    configs += [(m, b) for m in methods if m != "full" for b in budgets]
    rows: list[DemoRow] = []
    bar = tqdm(total=samples * len(configs), desc="demo", unit="run")
    for i in range(samples):
        sample = make_needle_sample(tokenizer, length, seed=seed + i)
        ctx, qst = encode_pair(tokenizer, sample.context, sample.question)
        check_positions(model, len(ctx) + len(qst), max_new_tokens, what="the needle prompt with its question", fix=fix)
        ids, mask = left_pad([ctx + qst], pad_id)
        ids, mask = ids.to(device), mask.to(device)
        states, logits = prefill(model, ids, mask, window=window)
        first = logits.argmax(-1)
        for method, budget in configs:
            start = time.perf_counter()
            cache = CompressedCache.from_states(states, method, budget)
            compressed_at = time.perf_counter()
            kv, kv_full = cache.kv_bytes(), cache.kv_bytes_full()
            new = continue_generation(model, cache, ids, mask, first, max_new_tokens, pad_token_id=pad_id)
            done = time.perf_counter()
            tokens = new[0].tolist()
            answer = decode_answers(tokenizer, new[:1], eos)[0][0]
            rows.append(
                DemoRow(
                    sample=i,
                    method=method,
                    budget=budget,
                    exact=exact_match(answer, sample.answer),
                    digits=digit_credit(answer, sample.answer),
                    answer=answer,
                    target=sample.answer,
                    kv_bytes=kv,
                    kv_bytes_full=kv_full,
                    compress_s=compressed_at - start,
                    decode_s=done - compressed_at,
                    new_tokens=max(len(tokens), 1),
                )
            )
            bar.update(1)
        del states
    bar.close()
    return rows


def summarise(rows: Sequence[DemoRow]) -> list[dict[str, Any]]:
    """Mean accuracy, digit credit, KV memory and time per (method, budget)."""
    groups: dict[tuple[str, Budget], list[DemoRow]] = defaultdict(list)
    for row in rows:
        groups[(row.method, row.budget)].append(row)
    table = []
    for (method, budget), items in groups.items():
        n = len(items)
        table.append(
            {
                "method": method,
                "budget": budget,
                "samples": n,
                "accuracy": sum(r.exact for r in items) / n,
                "digit_credit": sum(r.digits for r in items) / n,
                "kv_mb": sum(r.kv_bytes for r in items) / n / 2**20,
                "kv_ratio": sum(r.kv_bytes / r.kv_bytes_full for r in items) / n,
                "compress_ms": 1000 * sum(r.compress_s for r in items) / n,
                "decode_ms_per_token": 1000 * sum(r.decode_s for r in items) / sum(r.new_tokens for r in items),
            }
        )
    return table


def format_table(table: Sequence[dict[str, Any]]) -> str:
    """A fixed-width text table of :func:`summarise`'s output."""
    head = f"{'method':<16} {'budget':>6} {'n':>3} {'acc':>6} {'digits':>6} {'KV MB':>7} {'KV/full':>7} "
    head += f"{'compress ms':>11} {'decode ms/tok':>13}"
    lines = [head, "-" * len(head)]
    for r in table:
        lines.append(
            f"{r['method']:<16} {r['budget']:>6} {r['samples']:>3} {r['accuracy']:>6.2f} {r['digit_credit']:>6.2f} "
            f"{r['kv_mb']:>7.2f} {r['kv_ratio']:>7.3f} {r['compress_ms']:>11.1f} {r['decode_ms_per_token']:>13.1f}"
        )
    return "\n".join(lines)


def plot(table: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Accuracy vs budget per method, and accuracy beside the KV memory each (method, budget) holds,
    as a PNG (:func:`figure`)."""
    plt = pyplot()
    fig = figure(table, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _memory_step(table: Sequence[dict[str, Any]], count: int) -> float:
    """How far apart (MB) the right panel sets the ``count`` methods of one budget: together they
    span half the smallest gap between two budgets' memory, so the budgets' groups stay apart."""
    levels = sorted({round(float(r["kv_mb"]), 3) for r in table})
    gaps = [b - a for a, b in itertools.pairwise(levels) if b - a > 0]
    return 0.5 * (min(gaps) if gaps else 1.0) / max(count - 1, 1)


def figure(table: Sequence[dict[str, Any]], title: str) -> Any:
    """The demo's two panels: every method in its colour, marker and line style of
    :func:`~criticalkv.plotting.method_style`; the methods of one budget side by side (equal
    accuracies stay visible, none hides under another or under the full cache's line), the full
    cache as a line (left) and a star (right), all in one legend beside the panels."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    full = next((r for r in table if r["method"] == "full"), None)
    methods = [m for m in dict.fromkeys(r["method"] for r in table) if m != "full"]
    budgets = sorted({float(r["budget"]) for r in table if r["method"] != "full"})
    x = category_axis(left, budgets, "KV budget (fraction of the prompt); methods of one budget side by side")
    step = _memory_step(table, len(methods))
    if full is not None:
        left.axhline(full["accuracy"], color="black", linestyle=":", zorder=1, label="full cache")
        right.plot([full["kv_mb"]], [full["accuracy"]], "*", color="black", markersize=13, label="full cache (memory)")
    for j, method in enumerate(methods):
        rows = sorted((r for r in table if r["method"] == method), key=lambda r: float(r["budget"]))
        style = {**method_style(method), "zorder": 3}
        left.plot([dodged(x[float(r["budget"])], j, len(methods)) for r in rows], [r["accuracy"] for r in rows],
                  label=method, **style)  # fmt: skip
        shift = (j - (len(methods) - 1) / 2) * step
        right.plot([r["kv_mb"] + shift for r in rows], [r["accuracy"] for r in rows], **style)
    left.set_ylabel("needle accuracy (exact)")
    left.set_title("accuracy by budget", fontsize=10)
    right.set_xlabel("KV cache held after compression (MB; methods of one budget set side by side)")
    right.set_title("accuracy beside the memory held", fontsize=10)
    for ax in (left, right):
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    handles, labels = left.get_legend_handles_labels()
    star, star_label = right.get_legend_handles_labels()
    fig.legend(handles + star, labels + star_label, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle(wrapped(title, 110), fontsize=10)
    fig.tight_layout()
    return fig


def write_outputs(rows: Sequence[DemoRow], out_dir: Path, title: str) -> tuple[str, Path]:
    """Write rows.jsonl, summary.json and demo.png to ``out_dir``; return the table text and plot path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "rows.jsonl").open("w") as fh:
        for row in rows:
            fh.write(json.dumps(asdict(row)) + "\n")
    table = summarise(rows)
    (out_dir / "summary.json").write_text(json.dumps(table, indent=2))
    png = out_dir / "demo.png"
    plot(table, png, title)
    return format_table(table), png


def replot(out_dir: Path, title: str) -> Path:
    """Draw ``out_dir/demo.png`` again from the folder's ``rows.jsonl`` (nothing is rerun)."""
    lines = (out_dir / "rows.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [DemoRow(**json.loads(line)) for line in lines if line.strip()]
    png = out_dir / "demo.png"
    plot(summarise(rows), png, title)
    return png
