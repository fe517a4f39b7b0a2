"""What criticalkv's transformers path does on a prompt, for comparison with the vLLM plugin: the kept
positions of every (layer, KV head) and the greedy tokens of the physically compressed cache."""

from __future__ import annotations

from typing import Any

import torch

import criticalkv as ckv
from criticalkv.budgets.resolve import resolve_budget
from criticalkv.runtime import prompt_states


def kept_positions(model: Any, ids: list[int], method: str, budget: float, window: int) -> list[list[list[int]]]:
    """Per layer, per KV head, the sorted prompt positions the method keeps (transformers path)."""
    chosen = ckv.get_method(method)
    tensor = torch.tensor([ids])
    states, _ = prompt_states(model, tensor, torch.ones_like(tensor), chosen.needs, window=window)
    tokens = resolve_budget(budget, torch.tensor([len(ids)]), window)
    masks = chosen.keep_masks(states, tokens)
    return [[torch.nonzero(head).flatten().tolist() for head in mask[0]] for mask in masks]


def greedy_tokens(model: Any, ids: list[int], method: str, budget: float, window: int, count: int) -> list[int]:
    """``count`` greedy tokens after ``ids`` with criticalkv's compressed cache (EOS not stopping)."""
    cache = ckv.CompressedCache.for_model(model, method, budget, window=window)
    tensor = torch.tensor([ids])
    out = model.generate(
        input_ids=tensor,
        attention_mask=torch.ones_like(tensor),
        max_new_tokens=count,
        min_new_tokens=count,
        do_sample=False,
        past_key_values=cache,
    )
    return out[0, len(ids) :].tolist()


def token_nll(model: Any, ids: list[int], continuation: list[int], method: str, budget: float, window: int) -> float:
    """Mean negative log-likelihood per token of ``continuation`` after ``ids``, decoded through
    criticalkv's compressed cache (teacher-forced)."""
    cache = ckv.CompressedCache.for_model(model, method, budget, window=window)
    tensor = torch.tensor([ids + continuation])
    with torch.no_grad():
        first = model(input_ids=tensor[:, : len(ids)], past_key_values=cache)
        rest = model(input_ids=tensor[:, len(ids) : -1], past_key_values=cache)
    logits = torch.cat([first.logits[:, -1:], rest.logits], dim=1)[0].float()
    target = torch.tensor(continuation)
    return float(torch.nn.functional.cross_entropy(logits, target))
