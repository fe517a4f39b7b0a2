"""Decoding one sample's (method, budget) rows: teacher forcing for fidelity, then greedy generation.

Without a decode budget every row is a batch row of one stacked cache
(:func:`~criticalkv.cache.batch.stacked.stacked_cache`), so the decode steps share every weight read.
With one, each row decodes in a cache of its own (a decode budget re-selects with one method per
cache, :func:`~criticalkv.cache.batch.stacked.decode_budget_cache`), and the gold answer is fed one
token per forward so the cache re-selects between answer tokens exactly as it does while
generating: the fidelity numbers then measure the decode budget too, not only the prompt's
compression. ``kv_bytes_peak`` is then the most the row's cache held during its generation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from criticalkv.cache.batch import decode_budget_cache, row_kv_bytes, stacked_cache
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.spec import CacheSpec
from criticalkv.methods import Method
from criticalkv.runtime import append_tokens, continue_generation, decode_answers, teacher_forced_logprobs
from criticalkv.state import LayerState


@dataclass(frozen=True)
class Continuation:
    """What every row decodes after its compressed prompt (one sample)."""

    ids: torch.Tensor  # (1, T) the prompt
    mask: torch.Tensor  # (1, T)
    last_logits: torch.Tensor  # (1, V) the prefill's last logits
    question: list[int]  # appended after the context (question-agnostic mode), else empty
    suffix: list[int]  # teacher-forced: the question (agnostic mode) then the gold answer
    answer_len: int
    max_new_tokens: int
    aware: bool  # question-aware mode: the question is in the prompt


@dataclass(frozen=True)
class RowOutcome:
    """One (method, budget) row of a sample, decoded."""

    logprobs: torch.Tensor  # (answer_len, V) of the gold answer, teacher-forced
    answer: str
    new_tokens: int
    kv_bytes: int  # the compressed prompt
    kv_bytes_full: int  # one row's uncompressed cache in the model's dtype (never quantized)
    kv_bytes_peak: int | None  # under a decode budget: the most the row's cache held
    compress_s: float
    decode_s: float  # generation of the batch the row was part of
    batch_rows: int


def decode_configs(
    model: Any,
    tokenizer: Any,
    eos: set[int],
    pad_id: int,
    states: Sequence[LayerState],
    after: Continuation,
    specs: Sequence[CacheSpec],
    *,
    held: bool = False,
) -> list[RowOutcome]:
    """The outcome of every row's spec (its method bound), in order. The rows share one storage;
    ``held``: the sweep holds its compressed rows at a decode budget (each row then decodes in a
    cache of its own, the full cache's too, and records its peak)."""
    if not held:
        cache, times = stacked_cache(states, specs)
        return _decode(model, tokenizer, eos, pad_id, cache, after, times, peak=False, stepwise=False)
    outcomes: list[RowOutcome] = []
    for spec in specs:
        if spec.decode is not None:
            cache, seconds = decode_budget_cache(states, spec)
            times = [seconds]
        else:  # the full cache, the reference: it keeps every entry
            cache, times = stacked_cache(states, [spec])
        outcomes += _decode(model, tokenizer, eos, pad_id, cache, after, times, peak=True, stepwise=True)
    return outcomes


def reference_logprobs(model: Any, states: Sequence[LayerState], after: Continuation, full: Method) -> torch.Tensor:
    """The gold answer's teacher-forced log-probs on the unquantized full cache, (answer_len, V)."""
    cache, _ = stacked_cache(states, [CacheSpec(full, 1.0, states[0].window)])
    first_logits = after.last_logits if after.aware else None
    return teacher_forced_logprobs(model, cache, after.mask, after.suffix, after.answer_len, first_logits)[0]


def _decode(
    model: Any,
    tokenizer: Any,
    eos: set[int],
    pad_id: int,
    cache: CompressedCache,
    after: Continuation,
    compress_times: list[float],
    *,
    peak: bool,
    stepwise: bool,
) -> list[RowOutcome]:
    k = len(compress_times)
    kv_rows = row_kv_bytes(cache)
    full_bytes = cache.kv_bytes_full() // k  # the prompt's, before anything is appended
    mask = after.mask.expand(k, -1)
    first_logits = after.last_logits.expand(k, -1) if after.aware else None
    logprobs = teacher_forced_logprobs(
        model, cache.fork(), mask, after.suffix, after.answer_len, first_logits, one_token_steps=stepwise
    )
    started = time.perf_counter()
    ids = after.ids.expand(k, -1)
    if after.aware:
        first = after.last_logits.argmax(-1).expand(k)
    else:
        question = torch.tensor([after.question], dtype=torch.long, device=ids.device).expand(k, -1)
        out, mask = append_tokens(model, cache, mask, question)
        ids = torch.cat([ids, question], 1)
        first = out.logits[:, -1].argmax(-1)
    generated = continue_generation(model, cache, ids, mask, first, after.max_new_tokens, pad_token_id=pad_id)
    decode_s = time.perf_counter() - started
    answers, counts = decode_answers(tokenizer, generated, eos)
    held = cache.kv_bytes_peak() if peak else None
    return [
        RowOutcome(logprobs[i], answers[i], counts[i], kv_rows[i], full_bytes, held, compress_times[i], decode_s, k)
        for i in range(k)
    ]
