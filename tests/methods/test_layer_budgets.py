"""PyramidKV's layer-wise and HeadKV's head-prior budgets: hand-computed examples, totals,
floors, monotonicity and bad parameters."""

from __future__ import annotations

import math

import pytest
import torch

import criticalkv as ckv
from criticalkv.budgets import HeadPrior, Pyramid
from criticalkv.budgets.apportion import capped_shares, largest_remainder
from criticalkv.state import LayerState
from tests.helpers.random_state import random_state


def long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


# --- pyramid -------------------------------------------------------------------------------------


def test_pyramid_hand_example() -> None:
    """b = 25, w = 5, beta = 20, 5 layers: b' = 20 runs from 39 down to 1 in steps of 9.5."""
    budgets = Pyramid(beta=20).layer_budgets(long([25]), long([100]), window=5, num_layers=5)
    # shares 39, 29.5, 20, 10.5, 1: one extra entry for the tied halves goes to the shallower layer
    assert budgets.tolist() == [[5 + 39, 5 + 30, 5 + 20, 5 + 10, 5 + 1]]


def test_pyramid_top_layer_capped_by_the_prompt() -> None:
    """b_max would exceed what the row holds outside the window: lowered to it, b_min raised."""
    budgets = Pyramid(beta=20).layer_budgets(long([25]), long([30]), window=2, num_layers=3)
    assert budgets.tolist() == [[30, 25, 20]]  # shares 28, 23, 18 around b' = 23


@pytest.mark.parametrize("num_layers", [1, 2, 3, 7, 30])
@pytest.mark.parametrize("beta", [1.0, 1.5, 20.0, 1e6])
def test_pyramid_sum_monotone_floors(num_layers: int, beta: float) -> None:
    lengths = long([200, 57, 14, 300])
    window = 4
    budget = ckv.resolve_budget(0.3, lengths, window)
    budgets = Pyramid(beta=beta).layer_budgets(budget, lengths, window, num_layers)
    assert torch.equal(budgets.sum(-1), num_layers * budget)
    assert bool((budgets[:, 1:] <= budgets[:, :-1]).all())
    assert bool((budgets >= window).all()) and bool((budgets <= lengths[:, None]).all())
    if beta == 1.0 or num_layers == 1:
        assert torch.equal(budgets, budget[:, None].expand(-1, num_layers))


def test_pyramid_per_head_budgets_follow_the_layer() -> None:
    state = random_state(0, lengths=[40, 31], num_kv_heads=3, group=2, head_dim=4, window=3)
    budget = ckv.resolve_budget(0.5, state.lengths, 3)
    per_layer = Pyramid().layer_budgets(budget, state.lengths, 3, 4)
    for layer in range(4):
        layered = LayerState(**{**state.__dict__, "layer_idx": layer, "num_layers": 4})
        got = Pyramid()(torch.zeros(2, 3, 40), layered, budget)
        assert torch.equal(got, per_layer[:, layer, None].expand(-1, 3))


@pytest.mark.parametrize("beta", [0.99, 0.0, -2.0, math.nan, math.inf])
def test_pyramid_rejects_bad_beta(beta: float) -> None:
    with pytest.raises(ValueError, match="beta must be a finite number >= 1"):
        Pyramid(beta=beta)
    with pytest.raises(TypeError, match="beta must be a number"):
        Pyramid(beta="20")  # type: ignore[arg-type]


# --- head prior ----------------------------------------------------------------------------------


def test_head_prior_hand_example() -> None:
    """Fu et al. 2024, Eq. 4 on b' = b - w = 10 with 2 layers x 2 KV heads, scores [[1, 0], [2, 1]].

    Normalised scores 0.25, 0, 0.5, 0.25; beta = 1.5: pool = (10 / 1.5) * 4 = 26.67 and base
    10 - 10 / 1.5 = 3.33, so the shares are 10, 3.33, 16.67, 10 (sum 40). Largest remainder:
    floors 10, 3, 16, 10 (39) and the one entry left goes to the largest fraction (16.67).
    """
    prior = HeadPrior(beta=1.5).with_head_scores([[1.0, 0.0], [2.0, 1.0]])
    budgets = prior.model_budgets(long([14]), long([100]), window=4, num_layers=2, num_kv_heads=2)
    assert budgets.tolist() == [[[14, 7], [21, 14]]]
    # beta = 2: pool 20, base 5: shares 10, 5, 15, 10, all integers
    prior2 = HeadPrior(beta=2.0).with_head_scores([[1.0, 0.0], [2.0, 1.0]])
    assert prior2.model_budgets(long([14]), long([100]), 4, 2, 2).tolist() == [[[14, 9], [19, 14]]]


def test_head_prior_caps_a_head_at_the_prompt_and_redistributes() -> None:
    """beta = 1 gives all 24 selectable entries to head 0, which holds only n - w = 10."""
    prior = HeadPrior(beta=1.0).with_head_scores([[1.0, 0.0, 0.0]])
    budgets = prior.model_budgets(long([10]), long([12]), window=2, num_layers=1, num_kv_heads=3)
    assert budgets.tolist() == [[[12, 9, 9]]]  # the 14 left over shared equally (no other head has score)


@pytest.mark.parametrize("beta", [1.0, 1.005, 1.5, 5.0, 1e9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_head_prior_totals_and_floors(beta: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    layers, heads, window = 5, 3, 4
    scores = torch.rand(layers, heads, generator=g) ** 4  # skewed, some heads near zero
    lengths = long([300, 64, 17])
    budget = ckv.resolve_budget(0.25, lengths, window)
    budgets = HeadPrior(beta=beta).with_head_scores(scores).model_budgets(budget, lengths, window, layers, heads)
    assert torch.equal(budgets.sum((1, 2)), layers * heads * budget)
    assert bool((budgets >= window).all()) and bool((budgets <= lengths[:, None, None]).all())
    if beta == 1e9:  # beta -> infinity: uniform
        assert bool((budgets - budget[:, None, None]).abs().max() <= 1)


def test_head_prior_layer_call_and_shape_check() -> None:
    state = random_state(1, lengths=[40], num_kv_heads=2, group=3, head_dim=4, window=3)
    state = LayerState(**{**state.__dict__, "layer_idx": 1, "num_layers": 2})
    prior = HeadPrior().with_head_scores([[1.0, 2.0], [3.0, 4.0]])
    budget = long([12])
    expected = prior.model_budgets(budget, state.lengths, 3, 2, 2)[:, 1]
    assert torch.equal(prior(torch.zeros(1, 2, 40), state, budget), expected)
    wrong = HeadPrior().with_head_scores([[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=r"1 layers x 3 KV heads, but the model has 2 layers x 2 KV heads"):
        wrong(torch.zeros(1, 2, 40), state, budget)


def test_unbound_head_prior_says_how_to_get_scores() -> None:
    state = random_state(2, lengths=[20], num_kv_heads=1, group=1, head_dim=4, window=2)
    method = ckv.get_method("headkv")  # listing works without scores
    assert method.needs.head_scores and not method.bound
    with pytest.raises(ValueError, match="criticalkv head-scores"):
        method.keep_mask(state, long([8]))


@pytest.mark.parametrize("beta", [0.5, 0.999, -1.0, math.nan, math.inf])
def test_head_prior_rejects_bad_beta(beta: float) -> None:
    with pytest.raises(ValueError, match="beta must be a finite number >= 1"):
        HeadPrior(beta=beta)
    with pytest.raises(TypeError, match="beta must be a number"):
        HeadPrior(beta=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("scores", "message"),
    [
        ([[1.0, math.nan]], "finite"),
        ([[1.0, -0.5]], "non-negative"),
        ([[0.0, 0.0]], "all zero"),
        ([1.0, 2.0], "layers, KV heads"),
        ([[1.0, 2.0], [3.0]], "array of numbers"),
    ],
)
def test_head_prior_rejects_bad_scores(scores: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HeadPrior().with_head_scores(scores)  # type: ignore[arg-type]


# --- apportionment -------------------------------------------------------------------------------


def test_capped_shares_keeps_unbound_values_and_fills_caps() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, 1.0, 1.0]], dtype=torch.float64)
    out = capped_shares(values, torch.tensor([5.0, 5.0], dtype=torch.float64), torch.tensor([6.0, 12.0]).double())
    assert torch.allclose(out[0], values[0])
    assert torch.allclose(out[1], torch.tensor([5.0, 3.5, 3.5], dtype=torch.float64))


def test_largest_remainder_exact_totals() -> None:
    values = torch.tensor([[1.5, 1.5, 1.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    out = largest_remainder(values, long([4, 1]), long([3, 3]))
    assert out.tolist() == [[2, 1, 1], [0, 0, 1]]
