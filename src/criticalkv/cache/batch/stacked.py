"""Several compressions of one prompt as the rows of one cache, to decode them in one batch.

A sweep compares many (method, budget) pairs on the same prefill. Stacking them as batch rows
shares every weight read of the decode steps (the bulk of decode time on a small model) while
each row still holds only its own kept entries.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from criticalkv.budgets.resolve import Budget, resolve_budget
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.decode import DecodeCompression
from criticalkv.cache.spec import CacheSpec
from criticalkv.methods import Method, get_method
from criticalkv.state import LayerState


def keep_masks(
    states: Sequence[LayerState], method: Method, budget: Budget, at_most: int | None = None
) -> list[torch.Tensor]:
    """Per layer, the (B, H_kv, T) keep mask ``method`` chooses at ``budget`` (jointly over the
    layers for cross-layer budgets, see :meth:`Method.keep_masks`), at most ``at_most`` entries per
    KV head on average (a decode budget)."""
    tokens = resolve_budget(budget, states[0].lengths, states[0].window)
    return method.keep_masks(states, tokens if at_most is None else tokens.clamp(max=at_most))


def stacked_cache(states: Sequence[LayerState], specs: Sequence[CacheSpec]) -> tuple[CompressedCache, list[float]]:
    """One cache whose row ``i`` is the single-row prompt of ``states`` compressed as ``specs[i]``
    says (its method, bound, and budget), every row stored as the specs' one storage.

    The specs share one storage and the window ``states`` were prefilled with; a spec with a decode
    budget is refused (it re-selects with its own method: :func:`decode_budget_cache`). Returns the
    cache and the selection time of each spec (seconds).
    """
    _check_rows(states, specs)
    for spec in specs:
        if spec.decode is not None:
            raise ValueError("a spec with a decode budget is not stacked with others: use decode_budget_cache")
    return _stacked(states, specs, at_most=None)


def _check_rows(states: Sequence[LayerState], specs: Sequence[CacheSpec]) -> None:
    if not states or states[0].batch_size != 1:
        raise ValueError("stacking needs the prefill states of exactly one prompt (batch size 1)")
    if not specs:
        raise ValueError("stacking needs at least one spec")
    if len({spec.storage for spec in specs}) != 1:
        raise ValueError("the rows of one stacked cache share one storage")
    windows = {spec.window for spec in specs}
    if windows != {states[0].window}:
        asked = sorted(windows)
        raise ValueError(f"the states were prefilled with window {states[0].window}, the specs ask for {asked}")


def _stacked(
    states: Sequence[LayerState], specs: Sequence[CacheSpec], at_most: int | None
) -> tuple[CompressedCache, list[float]]:
    times: list[float] = []
    per_spec: list[list[torch.Tensor]] = []
    for spec in specs:
        start = time.perf_counter()
        per_spec.append(keep_masks(states, spec.method, spec.budget, at_most))
        times.append(time.perf_counter() - start)
    k = len(specs)
    whole = CacheSpec(get_method("full"), 1.0, states[0].window, storage=specs[0].storage)
    cache = CompressedCache.from_spec(len(states), whole)
    cache.real_prompt_tokens = states[0].lengths.repeat(k)
    for i, (layer, state) in enumerate(zip(cache.compressed_layers, states, strict=True)):
        keep = torch.cat([masks[i] for masks in per_spec], dim=0)
        layer.set_prefix(state.keys.expand(k, -1, -1, -1), state.values.expand(k, -1, -1, -1), keep)
    return cache, times


def decode_budget_cache(states: Sequence[LayerState], spec: CacheSpec) -> tuple[CompressedCache, float]:
    """A one-row cache of the prompt of ``states`` compressed as ``spec`` says, then held at its
    decode budget while it decodes (see :class:`~criticalkv.cache.decode.budget.DecodeCompression`).

    A decode budget re-selects with one method per cache, so such a spec is not stacked with
    others. Returns the cache and the prompt's selection time (seconds).
    """
    if spec.decode is None:
        raise ValueError("the spec has no decode budget: use stacked_cache")
    _check_rows(states, [spec])
    cache, times = _stacked(states, [spec], at_most=spec.decode.budget)
    held = DecodeCompression(spec.method, spec.decode.budget, spec.decode.interval, cache.window, len(states))
    held.install(cache.compressed_layers)
    for layer, state in zip(cache.compressed_layers, states, strict=True):
        held.after_prefill(layer, state)
    cache.decode = held
    return cache, times[0]


def row_kv_bytes(cache: CompressedCache) -> list[int]:
    """Bytes of keys and values each batch row holds in the compressed prompt."""
    totals: list[int] = []
    for layer in cache.compressed_layers:
        if not layer.holds_prompt:
            raise ValueError("the cache holds no compressed prompt")
        per_row = layer.segment_bytes().sum(-1)
        totals = per_row.tolist() if not totals else [a + b for a, b in zip(totals, per_row.tolist(), strict=True)]
    return [int(t) for t in totals]
