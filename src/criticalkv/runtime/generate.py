"""Answering questions about contexts with a compressed cache: prefill -> compress -> decode."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from criticalkv.budgets.resolve import Budget, resolve_budget, validate_budget
from criticalkv.cache.compressed_cache import CompressedCache, check_window
from criticalkv.cache.decode import DEFAULT_INTERVAL, check_decode_budget
from criticalkv.cache.quantized import (
    bits_per_element,
    check_quantized_decode,
    quantization_for,
    storage_options,
)
from criticalkv.compat import cache_argument
from criticalkv.methods import HeadScoresArg, Method, bind, get_method
from criticalkv.prompts import encode_pair, left_pad
from criticalkv.runtime.attach import attach
from criticalkv.runtime.forward import continue_generation, decode_answers, eos_ids, input_device, prefill, prefill_into
from criticalkv.runtime.limits import check_positions
from criticalkv.runtime.reconstruction import repeat_prompt
from criticalkv.scores.queries import resolve_num_queries

logger = logging.getLogger(__name__)

Mode = Literal["question-aware", "question-agnostic"]
MODES: tuple[str, ...] = ("question-aware", "question-agnostic")
#: default observation windows: the AdaKV repo (question-aware) and kvpress (question-agnostic)
DEFAULT_WINDOWS: dict[str, int] = {"question-aware": 32, "question-agnostic": 64}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


@dataclass
class GenerationResult:
    """What :func:`generate` returns (one entry per batch row where a list)."""

    answers: list[str]
    method: str
    budget: Budget
    mode: str
    window: int
    context_tokens: list[int]
    question_tokens: list[int]
    kv_bytes: int
    kv_bytes_full: int
    ttft_s: float
    total_s: float
    new_tokens: list[int] = field(default_factory=list)
    #: the most the cache held at any step, and what it held at the end (tail capacity included)
    kv_bytes_peak: int = 0
    kv_bytes_final: int = 0
    decode_budget: int | None = None
    decode_interval: int | None = None
    #: the storage precision (16: the model's dtype) and the bits per stored key/value element
    kv_bits: int = 16
    kv_bits_per_element: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first new token arrives."""

    def __init__(self, cache: CompressedCache) -> None:
        self.cache = cache
        self.calls = 0
        self.first_at: float | None = None
        self.kv_bytes_at_first = 0
        self.kv_bytes_full_at_first = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_at is None:  # call 1 is the prompt
            self.first_at = time.perf_counter()
            self.kv_bytes_at_first = self.cache.kv_bytes()
            self.kv_bytes_full_at_first = self.cache.kv_bytes_full()

    def end(self) -> None:
        pass


def _as_list(value: str | Sequence[str], name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = list(value)
    if not items:
        raise ValueError(f"no {name} given")
    return items


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    context: str | Sequence[str],
    question: str | Sequence[str],
    *,
    method: str | Method = "critical-adakv",
    budget: Budget = 0.2,
    mode: str = "question-aware",
    window: int | None = None,
    max_new_tokens: int = 32,
    chat: bool = True,
    head_scores: HeadScoresArg = None,
    decode_budget: int | None = None,
    decode_interval: int = DEFAULT_INTERVAL,
    kv_bits: int = 16,
    kv_group_size: int | None = None,
    kv_residual: int | None = None,
    **generate_kwargs: Any,
) -> GenerationResult:
    """Answer ``question`` about ``context`` with a compressed KV cache.

    ``question-aware``: the prompt (context + question) is compressed, the question sitting in
    the observation window (SnapKV's setting). ``question-agnostic``: the context alone is
    compressed, then the question is appended to the compressed cache.

    Lists of contexts and questions run as one left-padded batch. ``head_scores`` (a file or
    :class:`~criticalkv.headscores.HeadScores`) is bound for head-prior methods such as ``headkv``
    instead of the model's own. Extra keyword arguments go to ``model.generate`` (greedy by default).

    ``decode_budget`` holds the cache at that many entries per KV head on average while it
    generates, re-selecting a layer once it grew ``decode_interval`` entries per head beyond it
    (:mod:`criticalkv.cache.decode.budget`); with ``budget=1.0`` only the decode budget compresses.

    ``kv_bits`` 8 or 4 stores the kept entries quantized (``kv_group_size`` entries a scale and zero
    point, ``None``: 32 at 8 bits, 64 at 4 bits; the last ``kv_residual`` appended tokens exact;
    :class:`~criticalkv.cache.quantized.spec.KVQuantization`).

    Raises
    ------
    ValueError
        Before the model runs, if a prompt plus ``max_new_tokens`` exceeds the model's positions.
    """
    mode = check_mode(mode)
    method = bind(get_method(method), model, head_scores)  # once, before the cache exists
    budget = validate_budget(budget)
    window = check_window(DEFAULT_WINDOWS[mode] if window is None else window)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    if decode_budget is not None:
        check_decode_budget(method, window, decode_budget, decode_interval)
    quantization = quantization_for(kv_bits, kv_group_size, kv_residual, budget, config=model.config)
    check_quantized_decode(quantization, decode_budget)
    contexts, questions = _as_list(context, "context"), _as_list(question, "question")
    if len(contexts) != len(questions):
        raise ValueError(f"got {len(contexts)} contexts but {len(questions)} questions")
    attach(model)
    pairs = [encode_pair(tokenizer, c, q, chat) for c, q in zip(contexts, questions, strict=True)]
    check_positions(
        model,
        max(len(c) + len(q) for c, q in pairs),
        max_new_tokens,
        what="the prompt (context, question and chat template)",
        fix="shorten the context (keep the part the question needs) or lower max_new_tokens (--max-new-tokens)",
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = input_device(model)
    decode = {} if decode_budget is None else {"decode_budget": decode_budget, "decode_interval": decode_interval}
    storage = storage_options(quantization)
    compressed = [c + q for c, q in pairs] if mode == "question-aware" else [c for c, _ in pairs]
    shortest = min(len(s) for s in compressed)
    if quantization is not None:  # an explicit residual longer than the budget: refused before the prefill
        quantization.check_budget(int(resolve_budget(budget, torch.tensor([shortest]), window)[0]))
    if shortest < window:
        raise ValueError(
            f"the {'prompt' if mode == 'question-aware' else 'context'} has {shortest} tokens, fewer than "
            f"the observation window ({window}); use a longer context or a smaller --window"
        )
    full_ids, full_mask = left_pad([c + q for c, q in pairs], pad_id)
    if mode == "question-agnostic":
        ctx_ids, ctx_mask = left_pad([c for c, _ in pairs], pad_id)
        q_ids, q_mask = left_pad([q for _, q in pairs], pad_id)
        full_ids, full_mask = torch.cat([ctx_ids, q_ids], 1), torch.cat([ctx_mask, q_mask], 1)
    full_ids, full_mask = full_ids.to(device), full_mask.to(device)
    n_cmp = ctx_ids.shape[1] if mode == "question-agnostic" else full_ids.shape[1]
    kwargs: dict[str, Any] = {"do_sample": False, "pad_token_id": pad_id}
    kwargs.update(generate_kwargs)
    start = time.perf_counter()
    if method.needs.reconstruction:  # KVzip: capture the prefill, run the reconstruction pass, compress
        states, last = prefill(
            model,
            full_ids[:, :n_cmp],
            full_mask[:, :n_cmp],
            window=window,
            num_queries=resolve_num_queries(method.needs.queries, n_cmp),
            reconstruction=repeat_prompt(tokenizer, chat),
        )
        cache = CompressedCache.from_states(states, method, budget, window=window, **storage)
    else:
        cache = CompressedCache(model.config.num_hidden_layers, method, budget, window=window, **decode, **storage)
        if mode == "question-agnostic":
            prefill_into(model, cache, full_ids[:, :n_cmp], full_mask[:, :n_cmp])
    clock = _FirstTokenClock(cache)
    if method.needs.reconstruction and mode == "question-aware":  # the prompt is cached: its next token is known
        first = last.argmax(-1)
        clock.put(full_ids)
        clock.put(first)
        new = continue_generation(model, cache, full_ids, full_mask, first, max_new_tokens, streamer=clock, **kwargs)
        output = torch.cat([full_ids, new], dim=1)
    else:
        output = model.generate(
            input_ids=full_ids,
            attention_mask=full_mask,
            **cache_argument(model, cache),
            max_new_tokens=max_new_tokens,
            streamer=clock,
            **kwargs,
        )
    total = time.perf_counter() - start
    answers, counts = decode_answers(tokenizer, output[:, full_ids.shape[1] :], eos_ids(model, tokenizer))
    return GenerationResult(
        answers=answers,
        method=method.name,
        budget=budget,
        mode=mode,
        window=window,
        context_tokens=[len(c) for c, _ in pairs],
        question_tokens=[len(q) for _, q in pairs],
        kv_bytes=clock.kv_bytes_at_first or cache.kv_bytes(),
        kv_bytes_full=clock.kv_bytes_full_at_first or cache.kv_bytes_full(),
        ttft_s=(clock.first_at - start) if clock.first_at is not None else total,
        total_s=total,
        new_tokens=counts,
        kv_bytes_peak=cache.kv_bytes_peak(),
        kv_bytes_final=cache.kv_bytes(),
        decode_budget=decode_budget,
        decode_interval=None if decode_budget is None else decode_interval,
        kv_bits=16 if quantization is None else quantization.bits,
        kv_bits_per_element=bits_per_element(cache),
    )
