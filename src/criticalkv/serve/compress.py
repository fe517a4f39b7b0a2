"""Compressing a context or a prompt for the server: the checks a request gets before any work,
and the compression itself (KVzip's reconstruction pass included, quantized storage if set)."""

from __future__ import annotations

from typing import Any

import torch

from criticalkv.cache import CacheSpec, CompressedCache, PromptTooShort, bind_spec
from criticalkv.cache.batch import split_rows
from criticalkv.methods import bind, get_method
from criticalkv.prompts import left_pad
from criticalkv.runtime import RepeatPrompt, compress_prompt, compresses_in_prefill, input_device
from criticalkv.serve.errors import invalid


def check_compressible(spec: CacheSpec, tokens: int, what: str, param: str) -> None:
    """A 400 ``context_too_short`` naming ``param`` unless ``spec`` can compress ``tokens`` tokens (a
    ``what``: "document" or "prompt"), in the words of :meth:`~criticalkv.cache.CacheSpec.check_compressible`
    (the window is always kept, so each head's budget must hold it; with quantized storage an
    explicit full-precision residual must fit in it too)."""
    try:
        spec.check_compressible(tokens, what)
    except PromptTooShort as error:
        raise invalid(str(error), param, "context_too_short") from None


def check_methods(model: Any, names: tuple[str, ...]) -> None:
    """A ``ValueError`` saying what is missing unless every method in ``names`` can be bound to
    ``model`` (e.g. ``headkv`` without head scores for it), before the server accepts requests."""
    for name in names:
        try:
            bind(get_method(name), model)
        except ValueError as error:
            raise ValueError(f"method {name!r} cannot be served on this model: {error}") from error


@torch.no_grad()
def compress(model: Any, ids: list[int], spec: CacheSpec, repeat: RepeatPrompt) -> tuple[CompressedCache, torch.Tensor]:
    """``ids`` (one row) compressed as ``spec`` says: the cache and the (V,) logits that follow the
    last token, by :func:`criticalkv.runtime.compress_prompt` (KVzip's context-reconstruction pass
    with ``repeat``)."""
    spec = bind_spec(spec, model)
    tensor = torch.tensor([ids], dtype=torch.long, device=input_device(model))
    cache, last = compress_prompt(model, tensor, torch.ones_like(tensor), spec, reconstruction=repeat)
    return cache, last[0]


def batchable(spec: CacheSpec) -> bool:
    """Whether prompts compressed as ``spec`` says may share one batched prefill (:func:`compress_rows`):
    a method that selects during the prefill, over unquantized storage. A quantized cache cannot
    split its rows, and KVzip scores a reconstruction pass of each prompt: those are compressed alone."""
    return spec.storage is None and compresses_in_prefill(spec.method)


@torch.no_grad()
def compress_rows(model: Any, rows: list[list[int]], spec: CacheSpec) -> list[tuple[CompressedCache, torch.Tensor]]:
    """Several prompts compressed in one left-padded prefill (a :func:`batchable` ``spec`` only),
    each returned as its own single-row cache with the (V,) logits that follow it: the cache and
    logits :func:`compress` gives the prompt alone (:func:`~criticalkv.cache.batch.split_rows`)."""
    spec = bind_spec(spec, model)
    ids, mask = left_pad(rows, 0)
    device = input_device(model)
    cache, last = compress_prompt(model, ids.to(device), mask.to(device), spec)
    return list(zip(split_rows(cache, [len(row) for row in rows]), last, strict=True))
