"""The sweep runner: one full prefill per sample, every (method, budget) derived from it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from criticalkv.budgets.resolve import Budget
from criticalkv.cache.compressed_cache import check_window
from criticalkv.cache.stacked import row_kv_bytes, stacked_cache
from criticalkv.eval.dataset import load_dataset_file
from criticalkv.eval.fidelity import answer_logprobs, fidelity
from criticalkv.eval.metrics import char_credit, get_metric
from criticalkv.eval.ruler import TASK_NAMES, make_sample
from criticalkv.eval.sample import Sample
from criticalkv.eval.store import append_result, iter_done, open_run, result_key
from criticalkv.headscores.binding import bind_head_scores
from criticalkv.methods import get_method
from criticalkv.prompts import encode_pair, left_pad, positions
from criticalkv.runtime import DEFAULT_WINDOWS, check_mode, continue_generation, prefill
from criticalkv.scores.queries import QueriesNeeded, merge_queries_needed, queries_needed, resolve_num_queries

logger = logging.getLogger(__name__)


@dataclass
class SweepConfig:
    """What a sweep runs. ``identity()`` must match to resume into an existing folder."""

    out: Path
    benchmark: str = "ruler"
    tasks: list[str] = field(default_factory=lambda: list(TASK_NAMES))
    lengths: list[int] = field(default_factory=lambda: [1024])
    methods: list[str] = field(default_factory=lambda: ["full", "snapkv", "critical-snapkv", "adakv", "critical-adakv"])
    budgets: list[Budget] = field(default_factory=lambda: [0.1, 0.2, 0.4])
    samples: int = 10
    mode: str = "question-aware"
    model: str = "default"
    window: int | None = None
    seed: int = 0
    max_new_tokens: int | None = None
    chat: bool = True
    qa_source: str | None = None
    dataset: str | None = None

    def __post_init__(self) -> None:
        check_mode(self.mode)
        self.window = check_window(DEFAULT_WINDOWS[self.mode] if self.window is None else self.window)
        if self.benchmark not in ("ruler", "dataset"):
            raise ValueError(f"benchmark must be 'ruler' or 'dataset' (or use --dataset), not {self.benchmark!r}")
        if self.benchmark == "dataset" and not self.dataset:
            raise ValueError("the dataset benchmark needs --dataset PATH.jsonl")
        for task in self.tasks if self.benchmark == "ruler" else []:
            if task not in TASK_NAMES:
                raise ValueError(f"unknown RULER task {task!r}; choose from: {', '.join(TASK_NAMES)}")
        for method in self.methods:
            get_method(method)
        if self.samples < 1:
            raise ValueError("samples must be at least 1")
        if any(n < 128 for n in self.lengths):
            raise ValueError("lengths must be at least 128 tokens")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")

    def identity(self) -> dict[str, Any]:
        keys = ("benchmark", "model", "mode", "window", "seed", "max_new_tokens", "chat", "qa_source", "dataset")
        return {k: getattr(self, k) for k in keys}

    def configs(self) -> list[tuple[str, Budget]]:
        """(method, budget) pairs: ``full`` once at budget 1.0, every other method at every budget."""
        out: list[tuple[str, Budget]] = [("full", 1.0)] if "full" in self.methods else []
        return out + [(m, b) for m in self.methods if m != "full" for b in self.budgets]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["out"] = str(self.out)
        return data


def _samples(config: SweepConfig, tokenizer: Any) -> Iterator[tuple[int, Sample]]:
    if config.benchmark == "dataset":
        assert config.dataset is not None
        for sample in load_dataset_file(config.dataset)[: config.samples]:
            yield 0, sample
        return
    # sample-major: an interrupted sweep has covered every task and length with fewer samples
    for index in range(config.samples):
        for length in config.lengths:
            for task in config.tasks:
                yield length, make_sample(task, tokenizer, length, index, seed=config.seed, qa_source=config.qa_source)


def _gold_text(sample: Sample) -> str:
    return (" " if sample.answer_prefix else "") + ", ".join(sample.answers)


@torch.no_grad()
def run_sweep(config: SweepConfig, model: Any, tokenizer: Any) -> Path:
    """Run (or resume) a sweep; results go to ``config.out/results.jsonl``."""
    out = Path(config.out)
    open_run(out, config.identity(), config.to_json())
    done = set(iter_done(out))
    limit = getattr(model.config, "max_position_embeddings", None)
    cap = config.max_new_tokens or 128
    if limit is not None and any(n + cap > limit for n in config.lengths):
        raise ValueError(f"the model takes at most {limit} positions; lower --lengths (generation needs {cap} more)")
    pairs = config.configs()
    units = len(config.tasks) * len(config.lengths) * config.samples if config.benchmark == "ruler" else None
    total = units * len(pairs) if units is not None else None
    initial = 0
    if config.benchmark == "ruler":
        wanted = (
            f"{t}|{n}|{i}|{m}|{b}"
            for t in config.tasks
            for n in config.lengths
            for i in range(config.samples)
            for m, b in pairs
        )
        initial = sum(key in done for key in wanted)
    bar = tqdm(total=total, desc="eval", unit="run", initial=initial)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    window = int(config.window or 0)
    methods = {name: bind_head_scores(get_method(name), model) for name in {"full", *config.methods}}
    needed: QueriesNeeded = None
    for bound in methods.values():
        needed = merge_queries_needed(needed, queries_needed(bound.scores))
    for length, sample in _samples(config, tokenizer):
        keys = {
            (m, b): {"task": sample.task, "length": length, "index": sample.index, "method": m, "budget": b}
            for m, b in pairs
        }
        pending = [(m, b) for (m, b) in pairs if result_key(keys[(m, b)]) not in done]
        if not pending:
            continue
        ctx, qst = encode_pair(tokenizer, sample.context, sample.question, config.chat, sample.answer_prefix)
        gold = list(tokenizer(_gold_text(sample), add_special_tokens=False)["input_ids"])
        aware = config.mode == "question-aware"
        prompt = ctx + qst if aware else ctx
        max_new = min(sample.max_new_tokens, cap)
        needed = len(ctx) + len(qst) + max(max_new, len(gold))
        if limit is not None and needed > limit:
            raise ValueError(
                f"{sample.task} sample {sample.index} needs {needed} positions (prompt, chat template and answer), "
                f"more than the model's {limit}; lower --lengths"
            )
        ids, mask = left_pad([prompt], pad_id)
        ids, mask = ids.to(device), mask.to(device)
        started = time.perf_counter()
        states, last_logits = prefill(
            model, ids, mask, window=window, num_queries=resolve_num_queries(needed, len(prompt))
        )
        prefill_s = time.perf_counter() - started
        suffix = gold if aware else qst + gold
        metric = get_metric(sample.metric)
        # the full-cache reference first, then every pending config, all as rows of one batch
        rows = [("full", 1.0), *(p for p in pending if p != ("full", 1.0))]
        cache, compress_times = stacked_cache(states, [(methods[m], b) for m, b in rows])
        k = len(rows)
        kv_rows = row_kv_bytes(cache)
        kv_full = kv_rows[0]
        batch_mask = mask.expand(k, -1)
        first_logits = last_logits.expand(k, -1) if aware else None
        logprobs = answer_logprobs(model, cache.fork(), batch_mask, suffix, len(gold), first_logits)
        t1 = time.perf_counter()
        full_ids, full_mask = ids.expand(k, -1), batch_mask
        if aware:
            first = last_logits.argmax(-1).expand(k)
        else:
            q = torch.tensor([qst], dtype=torch.long, device=device).expand(k, -1)
            full_ids = torch.cat([full_ids, q], 1)
            full_mask = torch.cat([batch_mask, torch.ones_like(q)], 1)
            logits = model(
                input_ids=q, attention_mask=full_mask, position_ids=positions(full_mask)[:, -q.shape[1] :], cache=cache
            ).logits
            first = logits[:, -1].argmax(-1)
        generated = continue_generation(model, cache, full_ids, full_mask, first, max_new, pad_token_id=pad_id)
        decode_s = time.perf_counter() - t1
        eos = tokenizer.eos_token_id
        for row, (method, budget) in enumerate(rows):
            if row == 0 and ("full", 1.0) not in pending:
                continue
            new = generated[row].tolist()
            cut = new.index(eos) if eos in new else len(new)
            answer = str(tokenizer.decode(new[:cut], skip_special_tokens=True)).strip()
            fid = fidelity(logprobs[row], logprobs[0], gold)
            record = {
                **keys[(method, budget)],
                "mode": config.mode,
                "metric": sample.metric,
                "score": metric(answer, sample.answers),
                "partial": char_credit(answer, sample.answers),
                "nll": fid.nll,
                "kl": fid.kl,
                "top1": fid.top1,
                "prediction": answer,
                "answers": sample.answers,
                "context_tokens": len(ctx),
                "prompt_tokens": len(prompt),
                "kv_bytes": kv_rows[row],
                "kv_bytes_full": kv_full,
                "prefill_s": prefill_s,
                "compress_s": compress_times[row],
                "batch_decode_s": decode_s,
                "batch_rows": k,
                "new_tokens": cut,
                "meta": sample.meta,
            }
            append_result(out, record)
            done.add(result_key(record))
            bar.update(1)
        del cache
        del states
    bar.close()
    return out


def sweep_budgets(values: Sequence[Budget]) -> list[Budget]:
    """Sorted, de-duplicated budgets."""
    return sorted(set(values), key=float)
