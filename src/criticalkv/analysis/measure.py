"""Measuring one needle sample: every config's per-head perturbation, bound and hidden-state drift.

The model-driving code (the prefill and the teacher-forced decodes) is :func:`_prefill` and
:func:`_decode_hidden`; everything else works on the prefilled states.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from criticalkv.analysis.configs import Config
from criticalkv.analysis.drift import hidden_state_drift
from criticalkv.analysis.output_perturbation import (
    DEFAULT_CHUNK_BYTES,
    attention_weights,
    head_value_norms,
    output_perturbation,
)
from criticalkv.analysis.query_recording import recording_queries
from criticalkv.analysis.results_log import round_floats
from criticalkv.analysis.run_spec import RunSpec
from criticalkv.budgets.resolve import resolve_budget
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.eval.tasks import make_needle_sample
from criticalkv.methods import get_method
from criticalkv.prompts import encode_pair
from criticalkv.runtime import append_tokens, input_device, prefill
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)

#: relative and absolute slack of the bound check (float32 rounding of ``L``)
BOUND_RTOL, BOUND_ATOL = 1e-4, 1e-6


@dataclass
class _Prefilled:
    """One sample prefilled, with the full cache's decode of its answer as the reference."""

    states: list[LayerState]
    mask: torch.Tensor
    answer: torch.Tensor
    hidden_full: torch.Tensor
    decode_queries: list[torch.Tensor]
    depth: float


def _decode_hidden(model: Any, cache: CompressedCache, prompt_mask: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Final-layer hidden states (B, n, D) of the ``answer`` tokens decoded (teacher-forced) on ``cache``."""
    out, _ = append_tokens(model, cache, prompt_mask, answer, output_hidden_states=True, logits_to_keep=1)
    hidden: torch.Tensor = out.hidden_states[-1]
    return hidden.float()


def _prefill(model: Any, tokenizer: Any, index: int, spec: RunSpec) -> _Prefilled:
    """Prefill needle sample ``index`` and decode its answer on the full cache, recording the queries."""
    sample = make_needle_sample(tokenizer, spec.length, seed=spec.seed + index)
    ctx, qst = encode_pair(tokenizer, sample.context, sample.question, spec.chat)
    answer_ids = list(tokenizer(sample.answer, add_special_tokens=False)["input_ids"])
    if not answer_ids:
        raise ValueError(f"the tokenizer turns the answer {sample.answer!r} into no tokens")
    device = input_device(model)
    ids = torch.tensor([ctx + qst], dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    answer = torch.tensor([answer_ids], dtype=torch.long, device=device)
    states, _ = prefill(model, ids, mask, window=spec.window)
    full = CompressedCache.from_states(states, "full", 1.0)
    with recording_queries(model) as record:
        hidden_full = _decode_hidden(model, full, mask, answer)
    return _Prefilled(states, mask, answer, hidden_full, record.layers(len(states)), sample.depth)


def _compress(
    model: Any, pre: _Prefilled, index: int, spec: RunSpec, configs: Sequence[Config]
) -> tuple[list[list[torch.Tensor]], list[dict[str, Any]]]:
    """Each config's keep masks (per layer: (B, H_kv, T)) and its row with the drift measures."""
    tokens = {c.budget: int(resolve_budget(c.budget, pre.mask.sum(-1), spec.window)[0]) for c in configs}
    keeps: list[list[torch.Tensor]] = []
    rows: list[dict[str, Any]] = []
    for config in configs:
        method = get_method(config.method)  # scores and value norms are memoised on the states
        cache = CompressedCache.from_states(pre.states, method, config.budget)
        keeps.append(cache.keep_masks())
        kept = cache.kept_entries()[:, 0]  # (L, H_kv)
        drift = hidden_state_drift(pre.hidden_full, _decode_hidden(model, cache, pre.mask, pre.answer))
        del cache
        rows.append(
            {
                "sample": index,
                "method": config.method,
                "base": config.base,
                "budget": config.budget,
                "budget_tokens": tokens[config.budget],
                "prompt_tokens": int(pre.mask.shape[1]),
                "answer_tokens": int(pre.answer.shape[1]),
                "depth": round(pre.depth, 6),
                "kept": kept.tolist(),
                **drift.means(),
            }
        )
    return keeps, rows


def _layer_stats(
    state: LayerState,
    decode_queries: torch.Tensor,
    keeps: torch.Tensor,
    max_chunk_bytes: int,
) -> dict[str, torch.Tensor]:
    """Per-config statistics of one layer: each (C, H_q) (means over queries) or (C,) counts."""
    w, t = state.window, state.seq_len
    n = decode_queries.shape[2]
    device = state.keys.device
    queries = torch.cat([state.queries[:, :, -w:], decode_queries.to(state.queries.dtype)], dim=2)
    query_positions = torch.cat(
        [torch.arange(t - w, t, device=device), torch.full((n,), t, dtype=torch.long, device=device)]
    )
    weights = attention_weights(queries, state.keys, state.scaling, query_positions, state.valid)
    weight: torch.Tensor = state.module.o_proj.weight  # type: ignore[union-attr,assignment]
    b, h_q, q, _ = weights.shape
    norms = head_value_norms(state.values, weight, max_chunk_bytes=max_chunk_bytes)  # once for all configs
    # bound the (B, H_q, C*Q, D) projected difference of output_perturbation: split the configs into groups
    group = max(1, max_chunk_bytes // (4 * b * h_q * q * weight.shape[0]))
    parts = [
        _group_stats(
            output_perturbation(
                weights, keeps[s : s + group], state.values, weight, norms=norms, max_chunk_bytes=max_chunk_bytes
            ),
            w,
        )
        for s in range(0, keeps.shape[0], group)
    ]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _group_stats(res: Any, w: int) -> dict[str, torch.Tensor]:
    """Means over the window and the decode queries, and the bound's counts, of batch row 0."""
    l1, sigma, theta = res.l1[:, 0].double(), res.sigma[:, 0], res.theta[:, 0]  # (c, H_q, Q)
    violated = l1 > theta * (1 + BOUND_RTOL) + BOUND_ATOL
    return {
        "perturbation_window": l1[..., :w].mean(-1),
        "perturbation_decode": l1[..., w:].mean(-1),
        "sigma_window": sigma[..., :w].mean(-1),
        "sigma_decode": sigma[..., w:].mean(-1),
        "theta_window": theta[..., :w].mean(-1),
        "theta_decode": theta[..., w:].mean(-1),
        "bound_violations": violated.sum(dim=(1, 2)),
        "bound_violations_sigma_above_half": (violated & (sigma > 0.5)).sum(dim=(1, 2)),
        "sigma_above_half": (sigma > 0.5).sum(dim=(1, 2)),
    }


def _add_head_stats(
    rows: list[dict[str, Any]], pre: _Prefilled, keeps: list[list[torch.Tensor]], spec: RunSpec, max_chunk_bytes: int
) -> None:
    """Add each config's per-layer, per-head measures (L x H_q lists, or summed counts) to its row."""
    per_layer = []
    for layer, state in enumerate(pre.states):
        stacked = torch.stack([keep[layer] for keep in keeps])  # (C, B, H_kv, T)
        per_layer.append(_layer_stats(state, pre.decode_queries[layer], stacked, max_chunk_bytes))
    for c, row in enumerate(rows):
        for name in per_layer[0]:
            values = torch.stack([stats[name][c] for stats in per_layer])  # (L, H_q) or (L,)
            row[name] = int(values.sum()) if values.dim() == 1 else round_floats(values.tolist())
        row["queries"] = spec.window + int(pre.answer.shape[1])


@torch.no_grad()
def measure_sample(
    model: Any,
    tokenizer: Any,
    index: int,
    spec: RunSpec,
    configs: Sequence[Config],
    *,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[dict[str, Any]]:
    """Measure every config on needle sample ``index``; one result row per config.

    One full prefill; each config is a :meth:`CompressedCache.from_states` of it, so all
    configs see the same keys, values and queries.

    Returns
    -------
    Rows (JSON-ready dicts): ``sample``, ``method``, ``base``, ``budget``, ``budget_tokens``,
    ``prompt_tokens``, ``answer_tokens``, ``depth``, ``kept`` (L x H_kv entries kept), the
    (L x H_q) means over queries ``perturbation_window``, ``perturbation_decode``,
    ``sigma_window``, ``sigma_decode``, ``theta_window``, ``theta_decode``, the counts
    ``queries`` (per layer and head, window + decode), ``sigma_above_half``,
    ``bound_violations``, ``bound_violations_sigma_above_half``, and ``hidden_l1``,
    ``hidden_l1_relative``, ``hidden_cosine`` (means over the answer tokens).
    """
    if not configs:
        return []
    started = time.perf_counter()
    pre = _prefill(model, tokenizer, index, spec)
    prefilled = time.perf_counter()
    keeps, rows = _compress(model, pre, index, spec, configs)
    compressed = time.perf_counter()
    _add_head_stats(rows, pre, keeps, spec, max_chunk_bytes)
    logger.debug(
        "sample %d: prefill and full decode %.1f s, %d compressions and decodes %.1f s, per-head measures %.1f s",
        index,
        prefilled - started,
        len(configs),
        compressed - prefilled,
        time.perf_counter() - compressed,
    )
    return rows
