"""The operations every harness drives the model with: prefill with capture, compress, append
tokens, teacher-forced scoring, greedy decoding with one end-of-sequence rule.

Generation (:func:`criticalkv.generate`), the evaluation sweeps, fidelity, the perturbation
analysis, head-score computation, the demo and the benchmark all call these, so a change of
how the model is driven (positions, padding, the cache keyword, EOS) is made once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from criticalkv.cache.prefill import CaptureCache
from criticalkv.compat import cache_argument
from criticalkv.prompts import positions
from criticalkv.runtime.attach import attach
from criticalkv.runtime.limits import check_positions
from criticalkv.runtime.reconstruction import RepeatPrompt, reconstruct
from criticalkv.state import LayerState

_SHORTEN = "shorten the input (a shorter context or --length / --context-lengths)"


def input_device(model: Any) -> torch.device:
    """Where inputs go: the device of the input embeddings (the first one when a model is sharded)."""
    return model.get_input_embeddings().weight.device


@torch.no_grad()
def prefill(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    window: int,
    num_queries: int | None = None,
    reconstruction: RepeatPrompt | None = None,
) -> tuple[list[LayerState], torch.Tensor]:
    """Run the full prefill once; return every layer's state and the last position's (B, V) logits.

    Build any number of compressed caches from the states with
    :meth:`CompressedCache.from_states` and continue with :func:`continue_generation`. With
    ``reconstruction`` (a :func:`~criticalkv.runtime.repeat_prompt`, for methods whose
    ``needs.reconstruction`` is set: KVzip) the context-reconstruction pass runs too
    (:func:`~criticalkv.runtime.reconstruct`, about one more prefill).
    """
    states, logits = capture_prefill(
        model, input_ids, attention_mask, window=window, num_queries=num_queries, reconstruction=reconstruction
    )
    return states, logits[:, -1]


@torch.no_grad()
def capture_prefill(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    window: int,
    num_queries: int | None = None,
    logits_to_keep: int = 1,
    reconstruction: RepeatPrompt | None = None,
) -> tuple[list[LayerState], torch.Tensor]:
    """:func:`prefill` keeping the (B, logits_to_keep, V) logits of the last positions."""
    check_positions(model, int(input_ids.shape[1]), fix=_SHORTEN)
    attach(model)
    capture = CaptureCache(model.config.num_hidden_layers, window=window, num_queries=num_queries)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions(attention_mask),
        **cache_argument(model, capture),
        logits_to_keep=logits_to_keep,
    )
    states = capture.states()
    if reconstruction is not None:
        states = reconstruct(model, states, input_ids, attention_mask, reconstruction)
    return states, out.logits


@torch.no_grad()
def prefill_into(model: Any, cache: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Prefill ``input_ids`` into ``cache`` (a :class:`CompressedCache` compresses it as it goes);
    returns the (B, V) logits of the last position."""
    check_positions(model, int(input_ids.shape[1]), fix=_SHORTEN)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions(attention_mask),
        **cache_argument(model, cache),
        logits_to_keep=1,
    )
    return out.logits[:, -1]


@torch.no_grad()
def append_tokens(
    model: Any, cache: Any, attention_mask: torch.Tensor, tokens: torch.Tensor, **forward_kwargs: Any
) -> tuple[Any, torch.Tensor]:
    """Feed ``tokens`` (B, n) after what ``cache`` holds (described by ``attention_mask``, (B, T)).

    Returns the model's output (``.logits`` of the appended positions; ``forward_kwargs`` such
    as ``output_hidden_states=True`` go to the forward) and the (B, T + n) attention mask that
    now describes the cache. Positions continue each row's real tokens (padding skipped).
    """
    mask = torch.cat([attention_mask, torch.ones_like(tokens)], dim=1)
    out = model(
        input_ids=tokens,
        attention_mask=mask,
        position_ids=positions(mask)[:, -tokens.shape[1] :],
        **cache_argument(model, cache),
        **forward_kwargs,
    )
    return out, mask


@torch.no_grad()
def teacher_forced_logprobs(
    model: Any,
    cache: Any,
    prompt_mask: torch.Tensor,
    suffix: Sequence[int],
    answer_len: int,
    first_logits: torch.Tensor | None,
    *,
    one_token_steps: bool = False,
) -> torch.Tensor:
    """(B, answer_len, V) float32 log-probabilities of each gold answer position, teacher-forced.

    ``cache`` holds the prompt (it is extended: pass a fork). ``suffix`` is what follows the
    cached tokens: the question (question-agnostic mode) then the gold answer. With
    ``first_logits`` (B, V) (question-aware mode: the prefill's last logits) the suffix is the
    answer alone and its first token is predicted by those logits. Every row gets the same suffix.

    ``one_token_steps``: feed the question in one forward, then the answer one token per forward,
    as decoding does, instead of the whole suffix in one forward; a cache held at a decode budget
    (:mod:`criticalkv.cache.decode.budget`) then re-selects between answer tokens exactly as
    while generating, so each answer token sees what a generated token would have seen.
    """
    ids = torch.tensor([list(suffix)], dtype=torch.long, device=prompt_mask.device).expand(prompt_mask.shape[0], -1)
    if one_token_steps:
        return _stepwise_logprobs(model, cache, prompt_mask, ids, answer_len, first_logits)
    out, _ = append_tokens(model, cache, prompt_mask, ids)
    logits = out.logits.float()
    if first_logits is not None:
        picked = torch.cat([first_logits.float()[:, None, :], logits[:, : answer_len - 1]], dim=1)
    else:
        start = len(suffix) - answer_len - 1
        picked = logits[:, start : start + answer_len]
    return torch.log_softmax(picked, dim=-1)


def _stepwise_logprobs(
    model: Any,
    cache: Any,
    mask: torch.Tensor,
    ids: torch.Tensor,
    answer_len: int,
    first_logits: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`teacher_forced_logprobs` with the answer fed one token per forward."""
    head = int(ids.shape[1]) - answer_len  # the question (question-agnostic mode), else 0
    if first_logits is None and head < 1:
        raise ValueError("without first_logits the suffix must hold the question before the answer")
    pieces = [] if first_logits is None else [first_logits.float()[:, None, :]]
    if head:
        out, mask = append_tokens(model, cache, mask, ids[:, :head])
        pieces.append(out.logits[:, -1:].float())
    for i in range(head, int(ids.shape[1]) - 1):  # the last answer token predicts nothing we score
        out, mask = append_tokens(model, cache, mask, ids[:, i : i + 1])
        pieces.append(out.logits[:, -1:].float())
    return torch.log_softmax(torch.cat(pieces, dim=1), dim=-1)


@torch.no_grad()
def continue_generation(
    model: Any,
    cache: Any,
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


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The end-of-sequence ids of ``model``'s generation config and of ``tokenizer``, together."""
    ids: set[int] = set()
    for value in (_generation_eos(model), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _generation_eos(model: Any) -> Any:
    config = model.generation_config if hasattr(model, "generation_config") else None
    return None if config is None else config.eos_token_id


def decode_answers(tokenizer: Any, generated: torch.Tensor, eos: set[int]) -> tuple[list[str], list[int]]:
    """Each row of ``generated`` (B, n) cut before its first end-of-sequence token and decoded;
    returns the stripped texts and the number of tokens kept per row (the one EOS rule)."""
    answers, counts = [], []
    for row in generated.tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        counts.append(cut)
        answers.append(str(tokenizer.decode(row[:cut], skip_special_tokens=True)).strip())
    return answers, counts
