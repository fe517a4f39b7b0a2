"""The perturbation experiment: each base method against its Critical variant, per head.

For every needle sample (RULER-style context, question-aware prompt) one full prefill is run and
compressed by every (method, budget). Per layer and query head it measures, over the
observation-window queries and over the decode queries of the teacher-forced gold answer:

* the head-output perturbation ``||o - o_hat||_1``, the kept mass ``sigma`` and the bound
  ``theta`` (:mod:`criticalkv.analysis.perturbation`, :mod:`criticalkv.analysis.bound`);
* the final-layer hidden-state drift over the answer tokens, decoded through the compressed
  cache versus the full one (:mod:`criticalkv.analysis.drift`).

Decode queries are those of the full model (answer tokens decoded on the uncompressed cache);
their attention ``A`` is the softmax over the prompt keys only, the part of the cache that
compression touches (appended tokens are never evicted).

One JSON line per (sample, method, budget) is appended to ``results.jsonl`` as soon as a sample
is done; a re-run skips what is on disk (:class:`criticalkv.analysis.store.ResultsLog`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from criticalkv.analysis.drift import hidden_state_drift
from criticalkv.analysis.perturbation import (
    DEFAULT_CHUNK_BYTES,
    attention_weights,
    head_value_norms,
    output_perturbation,
)
from criticalkv.analysis.queries import recording_queries
from criticalkv.analysis.store import RESULTS_FILE, ResultsLog, check_run_config, round_floats
from criticalkv.budgets.resolve import Budget, resolve_budget, validate_budget
from criticalkv.cache.compressed_cache import CompressedCache, check_window
from criticalkv.compat import cache_argument
from criticalkv.eval.needle import make_needle_sample
from criticalkv.methods import available_methods, get_method
from criticalkv.prompts import encode_pair, positions
from criticalkv.runtime import prefill
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)

CRITICAL_PREFIX = "critical-"
#: the comparisons the paper reports
DEFAULT_BASES = ("snapkv", "adakv")
DEFAULT_BUDGETS: tuple[Budget, ...] = (0.025, 0.05, 0.1, 0.2, 0.4)
#: relative and absolute slack of the bound check (float32 rounding of ``L``)
BOUND_RTOL, BOUND_ATOL = 1e-4, 1e-6


@dataclass(frozen=True)
class RunSpec:
    """What one output folder measures; every row in it shares these settings.

    Attributes
    ----------
    model : the model name given to :func:`criticalkv.load_model`.
    length : context length in tokens of each needle sample.
    window : observation window (question-aware: it holds the end of the question).
    seed : sample ``i`` is ``make_needle_sample(tokenizer, length, seed + i)``.
    chat : wrap the prompt in the tokenizer's chat template.
    """

    model: str
    length: int = 2048
    window: int = 32
    seed: int = 0
    chat: bool = True

    def __post_init__(self) -> None:
        check_window(self.window)
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 32:
            raise ValueError(f"length must be an integer of at least 32 tokens, not {self.length!r}")
        if self.window > self.length:
            raise ValueError(f"the window ({self.window}) is longer than the context ({self.length}); lower it")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Config:
    """One compression to measure: ``method`` at ``budget``, compared with ``base`` if it is a variant."""

    method: str
    budget: Budget
    base: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.method, str(self.budget)


def critical_variant(base: str) -> str:
    """The registered Critical variant of a base method (``snapkv`` -> ``critical-snapkv``).

    Raises
    ------
    ValueError
        If ``base`` is unknown, is itself a Critical variant, does not compress, or has no
        registered Critical variant.
    """
    method = get_method(base)
    if method.name.startswith(CRITICAL_PREFIX):
        raise ValueError(
            f"{method.name!r} is a Critical variant; pass its base method "
            f"({method.name[len(CRITICAL_PREFIX) :]!r}): each base is compared with its Critical variant"
        )
    if not method.compresses:
        raise ValueError(f"{method.name!r} keeps every entry (nothing to compare); pass a compressing base method")
    variant = CRITICAL_PREFIX + method.name
    if variant not in available_methods():
        bases = [m[len(CRITICAL_PREFIX) :] for m in available_methods() if m.startswith(CRITICAL_PREFIX)]
        raise ValueError(f"{method.name!r} has no registered Critical variant; choose among: {', '.join(bases)}")
    return variant


def comparison_configs(bases: Sequence[str], budgets: Sequence[Budget]) -> list[Config]:
    """Each base method and its Critical variant at each budget (the same per-head budgets)."""
    if not bases:
        raise ValueError("no base methods given; pass e.g. snapkv,adakv")
    if not budgets:
        raise ValueError("no budgets given; pass e.g. 0.05,0.1,0.2")
    configs = []
    for base in dict.fromkeys(bases):
        variant = critical_variant(base)
        for budget in dict.fromkeys(validate_budget(b) for b in budgets):
            configs += [Config(base, budget), Config(variant, budget, base=base)]
    return configs


def check_budgets(budgets: Sequence[Budget], length: int, window: int) -> None:
    """Refuse budgets that cannot hold the observation window on a context of ``length`` tokens.

    Raises
    ------
    ValueError
        Naming the budget, the tokens it stands for and the window.
    """
    for budget in budgets:
        budget = validate_budget(budget)
        if isinstance(budget, float):
            tokens = math.floor(budget * length)
            what = f"budget {budget} of {length} tokens is {tokens} tokens"
        else:
            tokens, what = budget, f"budget {budget} tokens is"
        if tokens < window:
            raise ValueError(
                f"{what}, below the observation window ({window} tokens), which every method keeps; "
                "raise the budget, lengthen the context or lower --window"
            )


def _decode_hidden(model: Any, cache: CompressedCache, prompt_mask: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Final-layer hidden states (B, n, D) of the ``answer`` tokens decoded (teacher-forced) on ``cache``."""
    mask = torch.cat([prompt_mask, torch.ones_like(answer)], dim=1)
    out = model(
        input_ids=answer,
        attention_mask=mask,
        position_ids=positions(mask)[:, -answer.shape[1] :],
        **cache_argument(model, cache),
        output_hidden_states=True,
        logits_to_keep=1,
    )
    hidden: torch.Tensor = out.hidden_states[-1]
    return hidden.float()


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
    parts: list[dict[str, torch.Tensor]] = []
    for start in range(0, keeps.shape[0], group):
        res = output_perturbation(
            weights, keeps[start : start + group], state.values, weight, norms=norms, max_chunk_bytes=max_chunk_bytes
        )
        l1, sigma, theta = res.l1[:, 0].double(), res.sigma[:, 0], res.theta[:, 0]  # (c, H_q, Q), batch row 0
        violated = l1 > theta * (1 + BOUND_RTOL) + BOUND_ATOL
        parts.append(
            {
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
        )
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


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
    sample = make_needle_sample(tokenizer, spec.length, seed=spec.seed + index)
    ctx, qst = encode_pair(tokenizer, sample.context, sample.question, spec.chat)
    answer_ids = list(tokenizer(sample.answer, add_special_tokens=False)["input_ids"])
    if not answer_ids:
        raise ValueError(f"the tokenizer turns the answer {sample.answer!r} into no tokens")
    device = next(model.parameters()).device
    ids = torch.tensor([ctx + qst], dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    answer = torch.tensor([answer_ids], dtype=torch.long, device=device)
    tokens = {c.budget: int(resolve_budget(c.budget, mask.sum(-1), spec.window)[0]) for c in configs}

    started = time.perf_counter()
    states, _ = prefill(model, ids, mask, window=spec.window)
    full = CompressedCache.from_states(states, "full", 1.0)
    with recording_queries(model) as record:
        hidden_full = _decode_hidden(model, full, mask, answer)
    decode_queries = record.layers(len(states))
    del full
    prefilled = time.perf_counter()

    keeps: list[list[torch.Tensor]] = []  # per config, per layer: (B, H_kv, T)
    rows: list[dict[str, Any]] = []
    for config in configs:
        method = get_method(config.method)  # scores and value norms are memoised on the states
        cache = CompressedCache.from_states(states, method, config.budget)
        keeps.append(cache.keep_masks())
        kept = cache.kept_entries()[:, 0]  # (L, H_kv)
        drift = hidden_state_drift(hidden_full, _decode_hidden(model, cache, mask, answer))
        del cache
        rows.append(
            {
                "sample": index,
                "method": config.method,
                "base": config.base,
                "budget": config.budget,
                "budget_tokens": tokens[config.budget],
                "prompt_tokens": int(ids.shape[1]),
                "answer_tokens": len(answer_ids),
                "depth": round(sample.depth, 6),
                "kept": kept.tolist(),
                **drift.means(),
            }
        )

    compressed = time.perf_counter()
    per_layer = []
    for layer, state in enumerate(states):
        stacked = torch.stack([keep[layer] for keep in keeps])  # (C, B, H_kv, T)
        per_layer.append(_layer_stats(state, decode_queries[layer], stacked, max_chunk_bytes))
    for c, row in enumerate(rows):
        for name in per_layer[0]:
            values = torch.stack([stats[name][c] for stats in per_layer])  # (L, H_q) or (L,)
            if values.dim() == 1:
                row[name] = int(values.sum())
            else:
                row[name] = round_floats(values.tolist())
        row["queries"] = spec.window + len(answer_ids)
    logger.debug(
        "sample %d: prefill and full decode %.1f s, %d compressions and decodes %.1f s, per-head measures %.1f s",
        index,
        prefilled - started,
        len(configs),
        compressed - prefilled,
        time.perf_counter() - compressed,
    )
    del states
    return rows


@dataclass(frozen=True)
class RunOutcome:
    """What :func:`run_perturbation` did."""

    measured: int
    skipped: int
    results: Path


def run_perturbation(
    model: Any,
    tokenizer: Any,
    spec: RunSpec,
    out_dir: Path,
    *,
    bases: Sequence[str] = DEFAULT_BASES,
    budgets: Sequence[Budget] = DEFAULT_BUDGETS,
    samples: int = 8,
    command: str | None = None,
    progress: bool = True,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> RunOutcome:
    """Measure ``samples`` needle samples for each base method and its Critical variant.

    Rows go to ``out_dir/results.jsonl`` as each sample finishes; rows already there are
    skipped (a sample whose rows are all done costs nothing). ``out_dir/config.json`` records
    ``spec``, the provenance and ``command``; an existing folder must have the same ``spec``.

    Parameters
    ----------
    model, tokenizer : from :func:`criticalkv.load_model`.
    spec : the measurement settings (:class:`RunSpec`).
    out_dir : output folder.
    bases : base methods, each compared with its ``critical-`` variant.
    budgets : entries per KV head: fractions of the prompt or token counts; each must hold the window.
    samples : needle samples ``0 .. samples - 1``.
    command : the command line, recorded in the config file.
    progress : show a progress bar.
    max_chunk_bytes : bound on the large temporaries of the per-layer computation.

    Returns
    -------
    :class:`RunOutcome`.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive integer, not {samples!r}")
    configs = comparison_configs(bases, budgets)
    check_budgets([c.budget for c in configs], spec.length, spec.window)
    out_dir = Path(out_dir)
    check_run_config(out_dir, spec.to_dict(), command)
    log = ResultsLog(out_dir / RESULTS_FILE)
    done = log.done()
    todo = [[c for c in configs if (i, *c.key) not in done] for i in range(samples)]
    missing = sum(len(t) for t in todo)
    skipped = samples * len(configs) - missing
    if skipped:
        logger.info("%d of %d rows are already in %s; skipping them", skipped, samples * len(configs), log.path)
    bar = tqdm(total=missing, desc="perturbation", unit="row", disable=not progress)
    measured = 0
    try:
        for index, pending in enumerate(todo):
            if not pending:
                continue
            bar.set_postfix(sample=index)
            rows = measure_sample(model, tokenizer, index, spec, pending, max_chunk_bytes=max_chunk_bytes)
            log.append(rows)
            measured += len(rows)
            bar.update(len(rows))
    finally:
        bar.close()
    return RunOutcome(measured=measured, skipped=skipped, results=log.path)
