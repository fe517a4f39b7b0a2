"""Compressing a context or a prompt for the server: the checks a request gets before any work,
and the compression itself (KVzip's reconstruction pass included, quantized storage if set)."""

from __future__ import annotations

import math
from typing import Any

import torch

from criticalkv.budgets.resolve import resolve_budget
from criticalkv.cache import CacheSpec, CompressedCache, bind_spec
from criticalkv.cache.batch import split_rows
from criticalkv.cache.quantized import KVQuantization
from criticalkv.methods import bind, get_method
from criticalkv.prompts import left_pad
from criticalkv.runtime import RepeatPrompt, compress_prompt, compresses_in_prefill, input_device
from criticalkv.serve.errors import invalid


def compressible(tokens: int, budget: float, window: int, quantization: KVQuantization | None) -> bool:
    """Whether :func:`check_compressible` accepts ``tokens`` tokens at ``budget`` and ``window``."""
    try:
        per_head = int(resolve_budget(budget, torch.tensor([tokens]), window)[0])
    except ValueError:
        return False
    return quantization is None or quantization.residual is None or quantization.residual <= per_head


def check_compressible(
    tokens: int, budget: float, window: int, quantization: KVQuantization | None, what: str, param: str
) -> None:
    """A 400 naming ``param`` unless ``tokens`` tokens (a ``what``: "document" or "prompt") can be
    compressed at ``budget`` with an observation window of ``window`` tokens.

    The window is always kept, so each head's budget (``floor(budget * tokens)`` entries) must hold
    it; with quantized storage an explicit full-precision residual must fit in it too.
    """
    try:
        per_head = int(resolve_budget(budget, torch.tensor([tokens]), window)[0])
    except ValueError:
        kept = max(1, math.floor(budget * tokens))
        raise invalid(
            f"the {what} has {tokens} tokens: at budget {budget} each head keeps {kept} entries, fewer than the "
            f"observation window ({window} tokens), which is always kept; send a longer {what}, a larger budget "
            "or a smaller window",
            param,
            "context_too_short",
        ) from None
    if quantization is not None and quantization.residual is not None and quantization.residual > per_head:
        raise invalid(
            f"this server keeps each head's newest {quantization.residual} tokens exact (--kv-residual), but the "
            f"{what} ({tokens} tokens) keeps {per_head} entries per head at budget {budget}; send a longer {what} "
            "or a larger budget",
            param,
            "context_too_short",
        )


def check_methods(model: Any, names: tuple[str, ...]) -> None:
    """A ``ValueError`` saying what is missing unless every method in ``names`` can be bound to
    ``model`` (e.g. ``headkv`` without head scores for it), before the server accepts requests."""
    for name in names:
        try:
            bind(get_method(name), model)
        except ValueError as error:
            raise ValueError(f"method {name!r} cannot be served on this model: {error}") from error


@torch.no_grad()
def compress(
    model: Any,
    ids: list[int],
    method: str,
    budget: float,
    window: int,
    quantization: KVQuantization | None,
    repeat: RepeatPrompt,
) -> tuple[CompressedCache, torch.Tensor]:
    """``ids`` (one row) compressed by ``method`` at ``budget``: the cache and the (V,) logits that
    follow the last token, by :func:`criticalkv.runtime.compress_prompt` (KVzip's
    context-reconstruction pass with ``repeat``)."""
    spec = bind_spec(CacheSpec(get_method(method), budget, window, storage=quantization), model)
    tensor = torch.tensor([ids], dtype=torch.long, device=input_device(model))
    cache, last = compress_prompt(model, tensor, torch.ones_like(tensor), spec, reconstruction=repeat)
    return cache, last[0]


def batchable(method: str, quantization: KVQuantization | None) -> bool:
    """Whether prompts compressed by ``method`` may share one batched prefill (:func:`compress_rows`):
    a method that selects during the prefill, over 16-bit storage. A quantized cache cannot split
    its rows, and KVzip scores a reconstruction pass of each prompt: those are compressed alone."""
    return quantization is None and compresses_in_prefill(get_method(method))


@torch.no_grad()
def compress_rows(
    model: Any, rows: list[list[int]], method: str, budget: float, window: int
) -> list[tuple[CompressedCache, torch.Tensor]]:
    """Several prompts compressed in one left-padded prefill (:func:`batchable` methods only), each
    returned as its own single-row cache with the (V,) logits that follow it: the cache and logits
    :func:`compress` gives the prompt alone (:func:`~criticalkv.cache.batch.split_rows`)."""
    spec = bind_spec(CacheSpec(get_method(method), budget, window), model)
    ids, mask = left_pad(rows, 0)
    device = input_device(model)
    cache, last = compress_prompt(model, ids.to(device), mask.to(device), spec)
    return list(zip(split_rows(cache, [len(row) for row in rows]), last, strict=True))
