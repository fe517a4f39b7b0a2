"""Property-based invariants of top-k, budgets and selection on random layer states.

Runs on ``--device`` (tests/conftest.py): the cases are drawn on the CPU, then moved there."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import criticalkv as ckv
from criticalkv.budgets import Adaptive, HeadPrior, LayerJoint, Pyramid, Uniform
from criticalkv.scores import WindowAttention, projected_value_norms
from criticalkv.select import Critical, TopK, topk_mask
from criticalkv.state import LayerState
from tests.helpers.random_state import o_proj_weight, random_state, to_device
from tests.helpers.selection_cases import (
    Case,
    assert_valid_selection,
    cases,
    check_layer_varying_budgets,
    distinct_scores,
    masked_scores,
    method_for,
    top_entries,
)

COMPRESSING = [name for name in ckv.available_methods() if name != "full"]
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)


# --- topk_mask -----------------------------------------------------------------------------------


@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 6),
    n=st.integers(1, 30),
    ties=st.booleans(),
)
def test_topk_mask_takes_the_top_eligible(seed: int, rows: int, n: int, ties: bool, device: torch.device) -> None:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, n, generator=g)
    if ties:
        scores = scores.round().clamp(-1.0, 1.0)  # three values: many ties
    eligible = torch.rand(rows, n, generator=g) < 0.7
    k = torch.randint(0, n + 3, (rows,), generator=g)
    scores, eligible, k = scores.to(device), eligible.to(device), k.to(device)
    mask = topk_mask(scores, k, eligible)
    assert mask.shape == scores.shape and mask.dtype == torch.bool
    assert torch.equal(mask.sum(-1), torch.minimum(k, eligible.sum(-1)))
    assert not bool((mask & ~eligible).any())
    for r in range(rows):
        chosen = scores[r][mask[r]]
        unchosen = scores[r][eligible[r] & ~mask[r]]
        if chosen.numel() and unchosen.numel():
            assert float(chosen.min()) >= float(unchosen.max())


def test_topk_mask_counts_eligible_entries_scored_minus_inf(device: torch.device) -> None:
    """An eligible entry is chosen before any ineligible one, whatever its score."""
    inf = float("inf")
    scores = torch.tensor([[-inf, -inf, -inf], [2.0, -inf, -inf]], device=device)
    eligible = torch.tensor([[False, True, False], [True, False, True]], device=device)
    mask = topk_mask(scores, torch.tensor([1, 3], device=device), eligible)
    assert mask.tolist() == [[False, True, False], [True, False, True]]


def test_topk_mask_zero_and_batched_k(device: torch.device) -> None:
    scores = torch.tensor([[[3.0, 1.0, 2.0]], [[0.0, 5.0, 4.0]]], device=device)
    eligible = torch.ones_like(scores, dtype=torch.bool)
    assert not bool(topk_mask(scores, torch.zeros(2, 1, dtype=torch.long, device=device), eligible).any())
    mask = topk_mask(scores, torch.tensor([[1], [2]], device=device), eligible)
    assert mask.tolist() == [[[True, False, False]], [[False, True, True]]]


# --- every compressing method --------------------------------------------------------------------


@pytest.mark.parametrize("name", COMPRESSING)
@SETTINGS
@given(case=cases())
def test_method_keep_mask_invariants(name: str, case: Case, device: torch.device) -> None:
    case = case.to(device)
    method, state = method_for(name, case.state, seed=int(case.tokens[0]))
    keep = method.keep_mask(state, case.tokens)
    # what keep_mask allocates on: the scores, or the selection's ranking of them (DefensiveKV)
    budgets = method.budgets(method.ranked_scores(state, case.tokens), state, case.tokens)
    h = state.num_kv_heads
    if isinstance(method.budgets, Uniform):
        assert torch.equal(budgets, case.tokens[:, None].expand(-1, h))
    elif isinstance(method.budgets, (Pyramid, HeadPrior)):
        check_layer_varying_budgets(method, budgets, case)
    else:
        # adaptive; or joint over layers, here over this layer alone (tests/methods/test_defensive.py: all layers)
        assert isinstance(method.budgets, (Adaptive, LayerJoint))
        assert torch.equal(budgets.sum(-1), h * case.tokens)
    assert_valid_selection(keep, budgets, state)


@pytest.mark.parametrize("name", COMPRESSING)
@SETTINGS
@given(case=cases(zero_keys=True, zero_values=True))
def test_method_keep_mask_with_all_scores_tied(name: str, case: Case, device: torch.device) -> None:
    """Zero keys give uniform attention and zero values zero norms: ties everywhere."""
    case = case.to(device)
    method, state = method_for(name, case.state)
    keep = method.keep_mask(state, case.tokens)
    budgets = method.budgets(method.ranked_scores(state, case.tokens), state, case.tokens)
    if isinstance(method.budgets, (Pyramid, HeadPrior)):
        check_layer_varying_budgets(method, budgets, case)
    else:
        assert torch.equal(budgets.sum(-1), state.num_kv_heads * case.tokens)
    assert_valid_selection(keep, budgets, state)


@pytest.mark.parametrize("selector", [TopK(), Critical(), Critical(alpha=0.0), Critical(alpha=1.0)])
@SETTINGS
@given(case=cases(zero_values=True))
def test_selectors_with_equal_scores(selector: TopK | Critical, case: Case, device: torch.device) -> None:
    """Every eligible score equal (and every norm zero): the window survives, counts are exact."""
    case = case.to(device)
    state = case.state
    scores = torch.zeros(state.eligible.shape, device=device).masked_fill(~state.eligible, float("-inf"))
    for allocator in (Uniform(), Adaptive()):
        budgets = allocator(scores, state, case.tokens)
        assert_valid_selection(selector(scores, budgets, state), budgets, state)


def test_full_keeps_every_real_token(device: torch.device) -> None:
    state = random_state(0, lengths=[9, 12], num_kv_heads=2, group=2, head_dim=4, window=3)
    state = to_device(state, device)
    keep = ckv.get_method("full").keep_mask(state, torch.tensor([9, 12], device=device))
    assert torch.equal(keep, state.valid[:, None, :].expand(-1, 2, -1))


# --- adaptive budgets ----------------------------------------------------------------------------


@SETTINGS
@given(case=cases(), alpha_floor=st.floats(0.0, 1.0), random_scores=st.booleans())
def test_adaptive_budgets(case: Case, alpha_floor: float, random_scores: bool, device: torch.device) -> None:
    case = case.to(device)
    state = case.state
    if random_scores:
        scores = distinct_scores(state, seed=int(case.tokens.sum()))
    else:
        scores = masked_scores(ckv.get_method("adakv"), state)
    budgets = Adaptive(alpha_floor)(scores, state, case.tokens)
    h = state.num_kv_heads
    assert budgets.shape == (state.batch_size, h) and budgets.dtype == torch.long
    assert torch.equal(budgets.sum(-1), h * case.tokens)
    for row, b in enumerate(case.tokens.tolist()):
        floor = max(1, math.floor(alpha_floor * b))
        assert int(budgets[row].min()) >= max(floor, state.window)
        assert int(budgets[row].max()) <= int(state.lengths[row])
    assert torch.equal(Adaptive(1.0)(scores, state, case.tokens), case.tokens[:, None].expand(-1, h))


def test_adaptive_follows_the_scores(device: torch.device) -> None:
    """One head with all the mass takes everything above the other heads' safeguard."""
    state = random_state(1, lengths=[30], num_kv_heads=3, group=1, head_dim=4, window=2)
    state = to_device(state, device)
    scores = torch.rand(state.eligible.shape, generator=torch.Generator().manual_seed(0)).to(device)
    scores[:, 1] += 10.0
    scores = scores.masked_fill(~state.eligible, float("-inf"))
    budgets = Adaptive(0.2)(scores, state, torch.tensor([10], device=device))  # safeguard 2 = the window
    assert budgets.tolist() == [[2, 26, 2]]


# --- critical selection --------------------------------------------------------------------------


def _budgets(case: Case, scores: torch.Tensor, adaptive: bool) -> torch.Tensor:
    allocator = Adaptive() if adaptive else Uniform()
    return allocator(scores, case.state, case.tokens)


@SETTINGS
@given(case=cases(), alpha=st.floats(0.0, 1.0), adaptive=st.booleans())
def test_critical_stage1_keeps_the_attention_top(
    case: Case, alpha: float, adaptive: bool, device: torch.device
) -> None:
    case = case.to(device)
    state = case.state
    scores = distinct_scores(state, seed=int(case.tokens[0]))
    budgets = _budgets(case, scores, adaptive)
    keep = Critical(alpha=alpha)(scores, budgets, state)
    assert_valid_selection(keep, budgets, state)
    for row in range(state.batch_size):
        for head in range(state.num_kv_heads):
            k1 = max(math.floor(alpha * int(budgets[row, head])) - state.window, 0)
            top = top_entries(scores[row, head], k1, state.eligible[row, head])
            kept = set(keep[row, head].nonzero()[:, 0].tolist())
            assert top <= kept


@pytest.mark.parametrize("name", ["critical-snapkv", "critical-adakv"])
@SETTINGS
@given(case=cases())
def test_critical_methods_stage1_on_window_attention(name: str, case: Case, device: torch.device) -> None:
    case = case.to(device)
    method = ckv.get_method(name)
    state = case.state
    assert isinstance(method.select, Critical)
    scores = masked_scores(method, state)
    budgets = method.budgets(scores, state, case.tokens)
    keep = method.keep_mask(state, case.tokens)
    stage1 = topk_mask(
        scores,
        torch.clamp(torch.floor(method.select.alpha * budgets.double()).long() - state.window, min=0),
        state.eligible,
    )
    assert not bool((stage1 & ~keep).any())


@SETTINGS
@given(case=cases(), adaptive=st.booleans(), distinct=st.booleans())
def test_critical_with_alpha_one_is_topk(case: Case, adaptive: bool, distinct: bool, device: torch.device) -> None:
    case = case.to(device)
    state = case.state
    scores = distinct_scores(state, 7) if distinct else masked_scores(ckv.get_method("snapkv"), state)
    budgets = _budgets(case, scores, adaptive)
    assert torch.equal(Critical(alpha=1.0)(scores, budgets, state), TopK()(scores, budgets, state))


@SETTINGS
@given(case=cases(), adaptive=st.booleans())
def test_critical_with_alpha_zero_ranks_by_attention_times_norm(
    case: Case, adaptive: bool, device: torch.device
) -> None:
    case = case.to(device)
    state = case.state
    scores = distinct_scores(state, 11)
    budgets = _budgets(case, scores, adaptive)
    keep = Critical(alpha=0.0, eps=0.0)(scores, budgets, state)
    assert_valid_selection(keep, budgets, state)
    norms = projected_value_norms(state.values, o_proj_weight(state))
    weighted = scores * norms
    for row in range(state.batch_size):
        for head in range(state.num_kv_heads):
            k = int(budgets[row, head]) - state.window
            expected = top_entries(weighted[row, head], k, state.eligible[row, head])
            picked = set((keep[row, head] & state.eligible[row, head]).nonzero()[:, 0].tolist())
            assert picked == expected


def test_critical_differs_from_topk_when_norms_disagree(device: torch.device) -> None:
    """Stage 2 is not attention top-k: a low-attention entry with a huge value norm gets in."""
    state = random_state(3, lengths=[20], num_kv_heads=1, group=2, head_dim=4, window=2)
    state = to_device(state, device)
    scores = torch.linspace(1.0, 0.5, 20, device=device)[None, None].clone()
    scores = scores.masked_fill(~state.eligible, float("-inf"))
    values = state.values.clone()
    values[0, 0, 17] *= 1e3  # lowest eligible attention, largest norm
    state = LayerState(**{**state.__dict__, "values": values})
    budgets = torch.tensor([[6]], device=device)
    critical = Critical()(scores, budgets, state)
    topk = TopK()(scores, budgets, state)
    assert bool(critical[0, 0, 17]) and not bool(topk[0, 0, 17])
    assert bool(critical[0, 0, 0])  # stage 1 (floor(0.5 * 6) - 2 = 1 entry) keeps the top score


def test_window_attention_scores_ignore_padding_keys(device: torch.device) -> None:
    """Large padding keys must not change the attention of real tokens."""
    state = random_state(5, lengths=[10, 16], num_kv_heads=2, group=3, head_dim=4, window=3)
    state = to_device(state, device)
    scores = WindowAttention()(state)
    keys = state.keys.clone()
    keys[0, :, :6] = -keys[0, :, :6]
    other = WindowAttention()(LayerState(**{**state.__dict__, "keys": keys}))
    assert torch.allclose(scores[0, :, 6:], other[0, :, 6:])
