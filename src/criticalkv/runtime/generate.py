"""Answering questions about contexts with a compressed cache: prefill -> compress -> decode."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from criticalkv.budgets.resolve import Budget
from criticalkv.cache import CacheSpec, CompressedCache, bind_spec
from criticalkv.cache.quantized import bits_per_element
from criticalkv.compat import cache_argument
from criticalkv.defaults import DECODE_OPTIONS, DEFAULT_METHOD, STORAGE_OPTIONS
from criticalkv.defaults import DEFAULT_WINDOWS as DEFAULT_WINDOWS
from criticalkv.defaults import MODES as MODES
from criticalkv.methods import HeadScoresArg, Method
from criticalkv.prompts import encode_pair, left_pad
from criticalkv.runtime.attach import attach
from criticalkv.runtime.compress import compress_prompt, compresses_in_prefill
from criticalkv.runtime.forward import continue_generation, decode_answers, eos_ids, input_device
from criticalkv.runtime.limits import check_positions
from criticalkv.runtime.reconstruction import repeat_prompt

logger = logging.getLogger(__name__)

Mode = Literal["question-aware", "question-agnostic"]


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
    #: the storage precision as asked (16: the model's dtype, unquantized, or the quantized bit width)
    kv_bits: int = 16
    #: the bits of one stored key/value element: the quantized bit width, else the model dtype's (32 for float32)
    storage_bits: int = 16
    #: bits per key/value element the cache held when the first token was produced (what ``kv_bytes``
    #: counts: the prompt's kept entries; scales, zero points, full-precision residual and spare capacity included)
    kv_bits_per_element: float | None = None
    #: the same at the end (``kv_bytes_final``: generated tokens and the tail's spare capacity included)
    kv_bits_per_element_final: float | None = None

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
        self.bits_at_first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_at is None:  # call 1 is the prompt
            self.first_at = time.perf_counter()
            self.kv_bytes_at_first = self.cache.kv_bytes()
            self.kv_bytes_full_at_first = self.cache.kv_bytes_full()
            self.bits_at_first = bits_per_element(self.cache)

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
    method: str | Method = DEFAULT_METHOD,
    budget: Budget = 0.2,
    mode: str = "question-aware",
    window: int | None = None,
    max_new_tokens: int = 32,
    chat: bool = True,
    head_scores: HeadScoresArg = None,
    spec: CacheSpec | None = None,
    **kwargs: Any,
) -> GenerationResult:
    """Answer ``question`` about ``context`` with a compressed KV cache.

    ``question-aware``: the prompt (context + question) is compressed, the question sitting in
    the observation window (SnapKV's setting). ``question-agnostic``: the context alone is
    compressed, then the question is appended to the compressed cache.

    Lists of contexts and questions run as one left-padded batch. ``head_scores`` (a file or
    :class:`~criticalkv.headscores.HeadScores`) is bound for head-prior methods such as ``headkv``
    instead of the model's own.

    The cache is ``spec`` (a :class:`~criticalkv.cache.CacheSpec`, e.g. parsed from a command's
    flags), or the spec of ``method``, ``budget``, ``window`` (``None``: the mode's default) and the
    decode budget and storage keywords of :meth:`CacheSpec.of` among ``kwargs``: ``decode_budget``
    holds the cache at that many entries per KV head on average while it generates
    (:mod:`criticalkv.cache.decode.budget`; with ``budget=1.0`` only the decode budget compresses),
    ``kv_bits`` 8 or 4 stores the kept entries quantized
    (:class:`~criticalkv.cache.quantized.precision.KVQuantization`). The other ``kwargs`` go to
    ``model.generate`` (greedy by default).

    Raises
    ------
    ValueError
        Before the model runs, if a prompt plus ``max_new_tokens`` exceeds the model's positions,
        or a prompt is too short for the spec (:meth:`CacheSpec.check_compressible`).
    """
    mode = check_mode(mode)
    spec_options = {name: kwargs.pop(name) for name in (*DECODE_OPTIONS, *STORAGE_OPTIONS) if name in kwargs}
    if spec is None:
        window = DEFAULT_WINDOWS[mode] if window is None else window
        spec = CacheSpec.of(method, budget, window, config=model.config, **spec_options)
    elif spec_options:
        raise ValueError(f"pass {', '.join(spec_options)} inside the spec, not beside it")
    spec = bind_spec(spec, model, head_scores)  # once, before the cache exists
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    attach(model)
    prompts = _encode(
        model, tokenizer, context, question, chat=chat, mode=mode, spec=spec, max_new_tokens=max_new_tokens
    )
    generate_kwargs: dict[str, Any] = {"do_sample": False, "pad_token_id": prompts.pad_id, **kwargs}
    start = time.perf_counter()
    cache, clock, output = _answer(
        model, tokenizer, prompts, spec, chat=chat, max_new_tokens=max_new_tokens, **generate_kwargs
    )
    total = time.perf_counter() - start
    answers, counts = decode_answers(tokenizer, output[:, prompts.ids.shape[1] :], eos_ids(model, tokenizer))
    return GenerationResult(
        answers=answers,
        method=spec.method.name,
        budget=spec.budget,
        mode=mode,
        window=spec.window,
        context_tokens=[len(c) for c, _ in prompts.pairs],
        question_tokens=[len(q) for _, q in prompts.pairs],
        kv_bytes=clock.kv_bytes_at_first or cache.kv_bytes(),
        kv_bytes_full=clock.kv_bytes_full_at_first or cache.kv_bytes_full(),
        ttft_s=(clock.first_at - start) if clock.first_at is not None else total,
        total_s=total,
        new_tokens=counts,
        kv_bytes_peak=cache.kv_bytes_peak(),
        kv_bytes_final=cache.kv_bytes(),
        **_spec_fields(spec),
        storage_bits=spec.kv_bits if spec.storage is not None else torch.finfo(model.dtype).bits,
        kv_bits_per_element=clock.bits_at_first if clock.first_at is not None else bits_per_element(cache),
        kv_bits_per_element_final=bits_per_element(cache),
    )


def _spec_fields(spec: CacheSpec) -> dict[str, Any]:
    """The decode budget and storage fields of a :class:`GenerationResult`."""
    decode = spec.decode
    return {
        "decode_budget": None if decode is None else decode.budget,
        "decode_interval": None if decode is None else decode.interval,
        "kv_bits": spec.kv_bits,
    }


@dataclass
class _Prompts:
    """The encoded batch: each row's (context, question) ids, the left-padded prompt (B, T) on the
    model's device, and how many of its columns are compressed (all of them, or the contexts')."""

    pairs: list[tuple[list[int], list[int]]]
    ids: torch.Tensor
    mask: torch.Tensor
    compressed: int
    pad_id: int
    aware: bool


def _encode(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    context: str | Sequence[str],
    question: str | Sequence[str],
    *,
    chat: bool,
    mode: str,
    spec: CacheSpec,
    max_new_tokens: int,
) -> _Prompts:
    """Encode and left-pad the batch, refusing prompts the model or the spec cannot take (before the prefill)."""
    contexts, questions = _as_list(context, "context"), _as_list(question, "question")
    if len(contexts) != len(questions):
        raise ValueError(f"got {len(contexts)} contexts but {len(questions)} questions")
    pairs = [encode_pair(tokenizer, c, q, chat) for c, q in zip(contexts, questions, strict=True)]
    check_positions(
        model,
        max(len(c) + len(q) for c, q in pairs),
        max_new_tokens,
        what="the prompt (context, question and chat template)",
        fix="shorten the context (keep the part the question needs) or lower max_new_tokens (--max-new-tokens)",
    )
    aware = mode == "question-aware"
    spec.check_compressible(
        min(len(c) + len(q) if aware else len(c) for c, q in pairs), "prompt" if aware else "context"
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, mask = left_pad([c + q for c, q in pairs], pad_id)
    compressed = ids.shape[1]
    if not aware:  # the contexts padded on their own, the questions appended after them
        ctx_ids, ctx_mask = left_pad([c for c, _ in pairs], pad_id)
        q_ids, q_mask = left_pad([q for _, q in pairs], pad_id)
        ids, mask, compressed = torch.cat([ctx_ids, q_ids], 1), torch.cat([ctx_mask, q_mask], 1), ctx_ids.shape[1]
    device = input_device(model)
    return _Prompts(pairs, ids.to(device), mask.to(device), int(compressed), pad_id, aware)


def _answer(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    prompts: _Prompts,
    spec: CacheSpec,
    *,
    chat: bool,
    max_new_tokens: int,
    **kwargs: Any,
) -> tuple[CompressedCache, _FirstTokenClock, torch.Tensor]:
    """Compress and generate: the cache, the first-token clock and the (B, T + n) output ids.

    A question-aware prompt whose method selects during the prefill goes through
    ``model.generate`` with an empty cache; otherwise :func:`compress_prompt` compresses the
    prompt (or the contexts) first and generation continues from it.
    """
    ids, mask, n = prompts.ids, prompts.mask, prompts.compressed
    if prompts.aware and compresses_in_prefill(spec.method):
        cache = CompressedCache.from_spec(model.config.num_hidden_layers, spec)
        clock = _FirstTokenClock(cache)
        generate = model.generate(
            input_ids=ids,
            attention_mask=mask,
            **cache_argument(model, cache),
            max_new_tokens=max_new_tokens,
            streamer=clock,
            **kwargs,
        )
        return cache, clock, generate
    repeat = None if compresses_in_prefill(spec.method) else repeat_prompt(tokenizer, chat)  # KVzip's pass only
    cache, last = compress_prompt(model, ids[:, :n], mask[:, :n], spec, reconstruction=repeat)
    clock = _FirstTokenClock(cache)
    if not prompts.aware:  # the questions are appended to the compressed contexts
        output = model.generate(
            input_ids=ids,
            attention_mask=mask,
            **cache_argument(model, cache),
            max_new_tokens=max_new_tokens,
            streamer=clock,
            **kwargs,
        )
        return cache, clock, output
    first = last.argmax(-1)  # the prompt is cached: its next token is known
    clock.put(ids)
    clock.put(first)
    new = continue_generation(model, cache, ids, mask, first, max_new_tokens, streamer=clock, **kwargs)
    return cache, clock, torch.cat([ids, new], dim=1)
