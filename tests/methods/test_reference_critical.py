"""CriticalKV against a direct, loop-based reading of the paper's Algorithm 2 (``tests/helpers/naive_reference.py``).

The library runs on ``--device`` (tests/conftest.py); the references always run on the CPU in
float64, and the comparisons happen there.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import criticalkv as ckv
from criticalkv.budgets import Adaptive, HeadPrior, Pyramid
from criticalkv.scores import WindowAttention, projected_value_norms
from criticalkv.state import LayerState
from tests.helpers.naive_reference import (
    ALPHA_FLOOR,
    naive_adakv_budgets,
    naive_critical,
    naive_head_prior,
    naive_pyramid,
    naive_value_norms,
    naive_window_attention,
)
from tests.helpers.random_state import o_proj_weight, random_state, to_device
from tests.helpers.synthetic_scores import bind_synthetic


def exact(method: ckv.Method) -> ckv.Method:
    """``method`` with its value norms computed in the values' own dtype (float32 here), as the
    float64 references are; the default ``auto`` precision may use bfloat16."""
    return dataclasses.replace(method, select=dataclasses.replace(method.select, precision="exact"))


# (seed, lengths, H_kv, G, head_dim, window, budget)
CASES = [
    (0, [40], 2, 3, 8, 4, 0.3),
    (1, [33, 40, 21], 2, 2, 4, 3, 0.5),
    (2, [48, 30], 3, 1, 8, 6, 12),
    (3, [25, 25], 1, 4, 4, 2, 0.2),
    (4, [60, 45], 2, 3, 8, 8, 0.4),
    (5, [17, 36, 36, 29], 4, 2, 4, 5, 0.6),
    (6, [12, 9], 2, 2, 4, 9, 1.0),
    (7, [64, 50], 4, 1, 4, 2, 0.6),  # small window, large budget: AdaKV's safeguard matters
    (8, [56], 3, 2, 8, 1, 0.5),
]


def make_state(case: tuple, device: torch.device | str = "cpu") -> tuple[LayerState, torch.Tensor]:
    """The case's random state (drawn on the CPU) on ``device``, and its per-head budget there."""
    seed, lengths, h_kv, group, d, window, budget = case
    state = random_state(seed, lengths=lengths, num_kv_heads=h_kv, group=group, head_dim=d, window=window)
    state = to_device(state, device)
    return state, ckv.resolve_budget(budget, state.lengths, window)


# --- comparisons ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_window_attention_matches_naive(case: tuple, device: torch.device) -> None:
    state, _ = make_state(case, device)
    ours = WindowAttention()(state).double().cpu()
    ref = naive_window_attention(state)
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-5)  # padding too: zero, then pooled


@pytest.mark.parametrize("case", CASES[:3])
def test_window_attention_without_pooling_is_the_raw_window_mean(case: tuple, device: torch.device) -> None:
    state, _ = make_state(case, device)
    ours = WindowAttention(pool="none")(state).double().cpu()
    assert torch.allclose(ours, naive_window_attention(state, kernel=1), atol=1e-6)
    # each window query's weights sum to one over the real tokens, so their mean does too
    assert torch.allclose(ours.sum(-1), torch.ones(ours.shape[:2], dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("tokens_per_chunk", [None, 1, 3, 7])
def test_projected_value_norms_match_naive(
    case: tuple, p: int, tokens_per_chunk: int | None, device: torch.device
) -> None:
    state, _ = make_state(case, device)
    weight = o_proj_weight(state)
    b, h_kv, t, _ = state.values.shape
    kwargs = {}
    if tokens_per_chunk is not None:  # the (B, H_q, chunk, D) float32 temporary holds this many tokens
        kwargs["max_chunk_bytes"] = tokens_per_chunk * b * state.num_query_heads * weight.shape[0] * 4
    ours = projected_value_norms(state.values, weight, p=p, **kwargs)
    ref = naive_value_norms(state.values, weight, p=p)
    assert ours.dtype == torch.float32 and ours.shape == (b, h_kv, t)
    assert torch.allclose(ours.double().cpu(), ref, rtol=1e-4, atol=1e-4)


def test_projected_value_norms_tiny_chunk_budget(device: torch.device) -> None:
    """A byte bound below one token's temporary still works (one token per chunk)."""
    state, _ = make_state(CASES[4], device)
    weight = o_proj_weight(state)
    whole = projected_value_norms(state.values, weight)
    assert torch.allclose(projected_value_norms(state.values, weight, max_chunk_bytes=1), whole)


@pytest.mark.parametrize("case", CASES)
def test_critical_snapkv_matches_naive(case: tuple, device: torch.device) -> None:
    state, tokens = make_state(case, device)
    keep = exact(ckv.get_method("critical-snapkv")).keep_mask(state, tokens).cpu()
    attention = naive_window_attention(state)
    norms = naive_value_norms(state.values, o_proj_weight(state))
    budgets = tokens[:, None].expand(-1, state.num_kv_heads).cpu()
    assert torch.equal(keep, naive_critical(attention, norms, budgets, state))


@pytest.mark.parametrize("case", CASES)
def test_critical_adakv_matches_naive(case: tuple, device: torch.device) -> None:
    state, tokens = make_state(case, device)
    method = exact(ckv.get_method("critical-adakv"))
    assert method.scores is not None
    scores = method.scores(state).float().masked_fill(~state.eligible, float("-inf"))
    budgets = Adaptive(ALPHA_FLOOR)(scores, state, tokens).cpu()
    attention = naive_window_attention(state)
    # the library's AdaKV allocation equals the loop version on the naive scores
    assert torch.equal(budgets, naive_adakv_budgets(attention, state, tokens))
    keep = method.keep_mask(state, tokens).cpu()
    norms = naive_value_norms(state.values, o_proj_weight(state))
    assert torch.equal(keep, naive_critical(attention, norms, budgets, state))


@pytest.mark.parametrize("case", CASES)
def test_snapkv_and_adakv_match_naive_topk(case: tuple, device: torch.device) -> None:
    """The base methods are the same loops with stage 1 taking the whole budget (alpha = 1)."""
    state, tokens = make_state(case, device)
    attention = naive_window_attention(state)
    norms = naive_value_norms(state.values, o_proj_weight(state))
    uniform = tokens[:, None].expand(-1, state.num_kv_heads)
    adaptive = naive_adakv_budgets(attention, state, tokens)
    snapkv = ckv.get_method("snapkv").keep_mask(state, tokens).cpu()
    adakv = ckv.get_method("adakv").keep_mask(state, tokens).cpu()
    assert torch.equal(snapkv, naive_critical(attention, norms, uniform, state, alpha=1.0))
    assert torch.equal(adakv, naive_critical(attention, norms, adaptive, state, alpha=1.0))


@pytest.mark.parametrize("case", CASES[1:])
@pytest.mark.parametrize("alpha_floor", [0.2, 0.5])
def test_adakv_allocation_matches_naive_when_the_safeguard_binds(
    case: tuple, alpha_floor: float, device: torch.device
) -> None:
    """Heads whose scores differ in scale: the weak heads live on their safeguard."""
    state, tokens = make_state(case, device)
    g = torch.Generator().manual_seed(case[0])
    scale = 10.0 ** -torch.arange(state.num_kv_heads, dtype=torch.float32)  # 1, 0.1, 0.01, ...
    scores = torch.rand(state.eligible.shape, generator=g) * scale[None, :, None]
    scores = scores.to(device).masked_fill(~state.eligible, float("-inf"))
    budgets = Adaptive(alpha_floor)(scores, state, tokens)
    assert torch.equal(budgets.cpu(), naive_adakv_budgets(scores, state, tokens, alpha_floor))
    if state.num_kv_heads > 1 and max(math.floor(alpha_floor * int(b)) for b in tokens) > state.window:
        assert not torch.equal(budgets, Adaptive(0.0)(scores, state, tokens))  # the safeguard did something


# --- layer-wise and head-prior budgets (PyramidKV, HeadKV) ---------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layers", [1, 4])
def test_pyramid_budgets_match_naive(case: tuple, layers: int, device: torch.device) -> None:
    state, tokens = make_state(case, device)
    ours = Pyramid().layer_budgets(tokens, state.lengths, state.window, layers)
    for row in range(state.batch_size):
        expected = naive_pyramid(int(tokens[row]), int(state.lengths[row]), state.window, layers)
        assert ours[row].tolist() == expected


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("beta", [1.0, 1.5, 4.0])
def test_head_prior_budgets_match_naive(case: tuple, beta: float, device: torch.device) -> None:
    state, tokens = make_state(case, device)
    layers, heads = 3, state.num_kv_heads
    g = torch.Generator().manual_seed(case[0])
    scores = torch.rand(layers, heads, generator=g).double() ** 6  # skewed: some heads hit the cap
    prior = HeadPrior(beta=beta).with_head_scores(scores)
    ours = prior.model_budgets(tokens, state.lengths, state.window, layers, heads)
    flat = scores.flatten().tolist()
    for row in range(state.batch_size):
        expected = naive_head_prior(flat, int(tokens[row]), int(state.lengths[row]), state.window, beta)
        assert ours[row].flatten().tolist() == expected


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", ["critical-pyramidkv", "critical-headkv"])
def test_critical_on_layer_varying_budgets_matches_naive(case: tuple, name: str, device: torch.device) -> None:
    """CriticalPyramidKV and CriticalHeadKV: the base method's budgets, then the two stages."""
    state, tokens = make_state(case, device)
    attention = naive_window_attention(state)
    norms = naive_value_norms(state.values, o_proj_weight(state))
    for layer in range(3):
        layered = LayerState(**{**state.__dict__, "layer_idx": layer, "num_layers": 3})
        method = bind_synthetic(exact(ckv.get_method(name)), layered, seed=case[0])
        assert method.scores is not None
        budgets = method.budgets(method.scores(layered).float(), layered, tokens).cpu()
        keep = method.keep_mask(layered, tokens).cpu()
        assert torch.equal(keep, naive_critical(attention, norms, budgets, layered))
