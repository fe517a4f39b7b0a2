"""A compressed cache that holds a prompt accepts only continuations of it.

Without this check a cache reused for a new, unrelated prompt would silently append the new
tokens after the old compressed entries and answer from a mix of both. :func:`guard_reuse`
(installed by :func:`criticalkv.attach`) checks, before every forward of the model whose cache
is a :class:`CompressedCache` that holds a prompt:

* with a 2D attention mask, that it covers the tokens held plus the new ones (what ``generate``
  and the runtime pass when they decode, append a question or teacher-force an answer);
* without one, that the new positions start where the held tokens end;

and, at the first step of ``model.generate``, that a prompt passed in full begins with the token
ids the cache holds (recorded as they went in; unknown after embeddings or ``from_states``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from criticalkv.cache.compressed_cache import CompressedCache

_GUARDED = "_criticalkv_reuse_guard"


def reuse_error(held: int, what: str) -> ValueError:
    return ValueError(
        f"this CompressedCache already holds a compressed prompt of {held} tokens, and {what}: a cache only "
        "accepts continuations of what it holds. Use a fresh cache for a new prompt "
        "(CompressedCache.for_model(model, ...)), or call cache.fork() once per question to ask several "
        "questions of one compressed context"
    )


def _cache_of(kwargs: dict[str, Any]) -> CompressedCache | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, CompressedCache) else None


def check_forward(
    cache: CompressedCache,
    input_ids: torch.Tensor | None,
    new_tokens: int,
    attention_mask: Any,
    position_ids: Any,
) -> None:
    """Refuse a forward that cannot continue what ``cache`` holds; record the ids that go in."""
    if not cache.holds_prompt():
        cache.tokens.clear()
        cache.tokens.extend(input_ids)
        return
    held = cache.get_seq_length()
    if new_tokens == 0:
        raise reuse_error(held, "the input brings no new token")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        if attention_mask.shape[1] != held + new_tokens:
            raise reuse_error(
                held,
                f"the input's attention mask covers {attention_mask.shape[1]} tokens, where a continuation's "
                f"covers the {held} held plus the {new_tokens} new ones",
            )
    elif isinstance(position_ids, torch.Tensor) and new_tokens > 1:  # one-token decode steps: no sync
        first = int(position_ids[..., 0].max())
        if first != held:
            raise reuse_error(held, f"the new input's positions start at {first}, not {held}")
    cache.tokens.extend(input_ids)


def check_prompt(cache: CompressedCache, input_ids: Any, attention_mask: Any) -> None:
    """``generate``'s first step: a prompt passed in full must begin with the ids ``cache`` holds."""
    if not isinstance(input_ids, torch.Tensor) or not cache.holds_prompt():
        return
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != input_ids.shape[-1]:
        return  # only the new tokens were passed
    held = cache.get_seq_length()
    if input_ids.shape[1] <= held:
        raise reuse_error(held, f"the prompt passed to generate has {input_ids.shape[1]} tokens, no more than that")
    recorded = cache.tokens.ids()
    if recorded is None or recorded.shape[1] != held or recorded.shape[0] != input_ids.shape[0]:
        return
    if not torch.equal(input_ids[:, :held].to(recorded.device), recorded):
        raise reuse_error(held, "the prompt passed to generate does not begin with the tokens it holds")


def _before_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    cache = _cache_of(kwargs)
    if cache is None:
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    source = ids if isinstance(ids, torch.Tensor) else embeds
    if not isinstance(source, torch.Tensor):
        return
    check_forward(
        cache,
        ids if isinstance(ids, torch.Tensor) else None,
        int(source.shape[1]),
        kwargs.get("attention_mask"),
        kwargs.get("position_ids"),
    )


class _CheckedPrepare:
    """``model.prepare_inputs_for_generation`` with :func:`check_prompt` at the first step."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.__signature__ = inspect.signature(type(model).prepare_inputs_for_generation.__get__(model))

    def __call__(self, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        cache = _cache_of(kwargs)
        if cache is not None and (kwargs.get("is_first_iteration") or kwargs.get("next_sequence_length") != 1):
            check_prompt(cache, input_ids, kwargs.get("attention_mask"))
        return type(self.model).prepare_inputs_for_generation(self.model, input_ids, *args, **kwargs)


def guard_reuse(model: nn.Module) -> nn.Module:
    """Install the continuation checks on ``model`` (idempotent; returns the model)."""
    if model.__dict__.get(_GUARDED):
        return model
    model.register_forward_pre_hook(_before_forward, with_kwargs=True)
    if hasattr(type(model), "prepare_inputs_for_generation"):  # a generation model
        model.prepare_inputs_for_generation = _CheckedPrepare(model)  # type: ignore[assignment]
    model.__dict__[_GUARDED] = True
    return model
