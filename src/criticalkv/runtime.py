"""Prefill -> compress -> decode, through ``model.generate``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from criticalkv.budgets.resolve import Budget, validate_budget
from criticalkv.cache.attention import attach
from criticalkv.cache.capture import CaptureCache
from criticalkv.cache.compressed_cache import CompressedCache, check_window
from criticalkv.compat import cache_argument
from criticalkv.methods import Method, get_method
from criticalkv.prompts import encode_pair, left_pad, positions
from criticalkv.state import LayerState

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
    **generate_kwargs: Any,
) -> GenerationResult:
    """Answer ``question`` about ``context`` with a compressed KV cache.

    ``question-aware``: the prompt (context + question) is compressed, the question sitting in
    the observation window (SnapKV's setting). ``question-agnostic``: the context alone is
    compressed, then the question is appended to the compressed cache.

    Lists of contexts and questions run as one left-padded batch. Extra keyword arguments go
    to ``model.generate`` (greedy decoding by default).
    """
    mode = check_mode(mode)
    method = get_method(method)
    budget = validate_budget(budget)
    window = check_window(DEFAULT_WINDOWS[mode] if window is None else window)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    contexts, questions = _as_list(context, "context"), _as_list(question, "question")
    if len(contexts) != len(questions):
        raise ValueError(f"got {len(contexts)} contexts but {len(questions)} questions")
    attach(model)
    pairs = [encode_pair(tokenizer, c, q, chat) for c, q in zip(contexts, questions, strict=True)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    cache = CompressedCache.for_model(model, method, budget, window=window)
    compressed = [c + q for c, q in pairs] if mode == "question-aware" else [c for c, _ in pairs]
    shortest = min(len(s) for s in compressed)
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
    clock = _FirstTokenClock(cache)
    kwargs: dict[str, Any] = {"do_sample": False, "pad_token_id": pad_id}
    kwargs.update(generate_kwargs)
    start = time.perf_counter()
    if mode == "question-agnostic":
        n_ctx = ctx_ids.shape[1]
        model(
            input_ids=full_ids[:, :n_ctx],
            attention_mask=full_mask[:, :n_ctx],
            position_ids=positions(full_mask[:, :n_ctx]),
            **cache_argument(model, cache),
            logits_to_keep=1,
        )
    output = model.generate(
        input_ids=full_ids,
        attention_mask=full_mask,
        **cache_argument(model, cache),
        max_new_tokens=max_new_tokens,
        streamer=clock,
        **kwargs,
    )
    total = time.perf_counter() - start
    new = output[:, full_ids.shape[1] :]
    answers, counts = [], []
    eos = _eos_ids(model, tokenizer)
    for row in new.tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        counts.append(cut)
        answers.append(str(tokenizer.decode(row[:cut], skip_special_tokens=True)).strip())
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
    )


def _eos_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


@torch.no_grad()
def prefill(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    window: int,
    num_queries: int | None = None,
) -> tuple[list[LayerState], torch.Tensor]:
    """Run the full prefill once; return every layer's state and the last position's logits.

    Build any number of compressed caches from the states with
    :meth:`CompressedCache.from_states` and continue with :func:`continue_generation`.
    """
    attach(model)
    capture = CaptureCache(model.config.num_hidden_layers, window=window, num_queries=num_queries)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions(attention_mask),
        **cache_argument(model, capture),
        logits_to_keep=1,
    )
    return capture.states(), out.logits[:, -1]


@torch.no_grad()
def continue_generation(
    model: Any,
    cache: CompressedCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    first_token: torch.Tensor,
    max_new_tokens: int,
    **generate_kwargs: Any,
) -> torch.Tensor:
    """Greedy continuation after a prefill whose next token is ``first_token`` (B,).

    ``cache`` holds the whole prompt ``input_ids``; returns (B, n) new tokens, the first
    one included.
    """
    first = first_token.view(-1, 1).to(input_ids.device)
    if max_new_tokens <= 1:
        return first
    ids = torch.cat([input_ids, first], dim=1)
    mask = torch.cat([attention_mask, torch.ones_like(first)], dim=1)
    kwargs: dict[str, Any] = {"do_sample": False}
    kwargs.update(generate_kwargs)
    out = model.generate(
        input_ids=ids, attention_mask=mask, **cache_argument(model, cache), max_new_tokens=max_new_tokens - 1, **kwargs
    )
    return out[:, input_ids.shape[1] :]
