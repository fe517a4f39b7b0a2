"""Random selection cases (hypothesis strategies) and the checks the invariant tests share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import assume
from hypothesis import strategies as st

import criticalkv as ckv
from criticalkv.budgets import HeadPrior, Pyramid
from criticalkv.budgets.resolve import Budget
from criticalkv.cache.layouts import build_prefix
from criticalkv.needs import ALL_QUERIES
from criticalkv.state import LayerState
from tests.helpers.random_state import random_state, to_device, with_all_queries, with_reconstruction
from tests.helpers.synthetic_scores import bind_synthetic


@dataclass(frozen=True)
class Case:
    """A random layer state with a budget that the state can hold."""

    state: LayerState
    budget: Budget
    tokens: torch.Tensor  # (B,) entries per head, from resolve_budget

    def to(self, device: torch.device) -> Case:
        return Case(to_device(self.state, device), self.budget, self.tokens.to(device))


@st.composite
def cases(draw: st.DrawFn, zero_keys: bool = False, zero_values: bool = False) -> Case:
    window = draw(st.integers(1, 6))
    batch = draw(st.integers(1, 3))
    longest = draw(st.integers(window, 40))
    lengths = [draw(st.integers(window, longest)) for _ in range(batch - 1)] + [longest]
    lengths = draw(st.permutations(lengths))
    state = random_state(
        draw(st.integers(0, 2**16)),
        lengths=lengths,
        num_kv_heads=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([2, 4, 8])),
        hidden=draw(st.integers(3, 16)),
        window=window,
        num_queries=window + draw(st.integers(0, 2)),
        zero_keys=zero_keys,
        zero_values=zero_values,
    )
    num_layers = draw(st.integers(1, 4))  # layer-wise and head-prior budgets depend on the layer
    state = LayerState(
        **{**state.__dict__, "num_layers": num_layers, "layer_idx": draw(st.integers(0, num_layers - 1))}
    )
    shortest = min(lengths)
    tokens_budget = draw(st.integers(window, shortest))
    fraction_budget = draw(st.floats(window / shortest, 1.0))
    budget: Budget = tokens_budget if draw(st.booleans()) else fraction_budget
    try:
        tokens = ckv.resolve_budget(budget, state.lengths, window)
    except ValueError:  # a fraction that rounds below the window
        assume(False)
    return Case(state, budget, tokens)


def masked_scores(method: ckv.Method, state: LayerState) -> torch.Tensor:
    """The scores ``Method.keep_mask`` hands to budgets and selection."""
    assert method.scores is not None
    return method.scores(state).float().masked_fill(~state.eligible, float("-inf"))


def distinct_scores(state: LayerState, seed: int) -> torch.Tensor:
    """(B, H_kv, T) pairwise distinct positive scores, ``-inf`` where not eligible."""
    g = torch.Generator().manual_seed(seed)
    n = state.batch_size * state.num_kv_heads * state.seq_len
    scores = (torch.randperm(n, generator=g).float() + 1.0).view(state.eligible.shape) / n
    return scores.to(state.eligible.device).masked_fill(~state.eligible, float("-inf"))


def assert_valid_selection(keep: torch.Tensor, budgets: torch.Tensor, state: LayerState) -> None:
    """Exact per-head counts, window kept, no padding, each kept entry stored once in order."""
    b, h, t = keep.shape
    assert keep.dtype == torch.bool
    assert keep.shape == (state.batch_size, state.num_kv_heads, state.seq_len)
    assert torch.equal(keep.sum(-1), budgets), (keep.sum(-1), budgets)
    assert bool(keep[..., t - state.window :].all()), "an observation-window entry was evicted"
    assert not bool((keep & ~state.valid[:, None, :]).any()), "a padding position was kept"
    # the ragged prefix built from the mask holds each kept position once, in position order
    pos = torch.arange(t, dtype=torch.float32, device=keep.device).view(1, 1, t, 1).expand(b, h, t, 1).contiguous()
    prefix = build_prefix(pos, pos, keep)
    assert prefix.num_entries == int(keep.sum())
    assert sum(tier.keys.shape[0] * tier.keys.shape[1] for tier in prefix.tiers) == int(keep.sum())
    flat = keep.reshape(b * h, t)
    for s in range(b * h):
        stored, _ = prefix.segment(s)
        stored_pos = stored[:, 0].long()
        assert bool((stored_pos[1:] > stored_pos[:-1]).all())
        assert torch.equal(stored_pos, flat[s].nonzero()[:, 0])


def top_entries(values: torch.Tensor, k: int, candidates: torch.Tensor) -> set[int]:
    """Indices of the ``k`` largest ``values`` among ``candidates`` (1-D)."""
    idx = candidates.nonzero()[:, 0]
    order = torch.argsort(values[idx], descending=True, stable=True)
    return set(idx[order[:k]].tolist())


def method_for(name: str, state: LayerState, seed: int = 0) -> tuple[ckv.Method, LayerState]:
    """The method, head-prior budgets bound to synthetic scores, and the state with every prompt
    query if its scores read them all (H2O)."""
    method = bind_synthetic(ckv.get_method(name), state, seed)
    if method.needs.queries == ALL_QUERIES:
        state = with_all_queries(state, seed)
    if method.needs.reconstruction:
        state = with_reconstruction(state)
    return method, state


def check_layer_varying_budgets(method: ckv.Method, budgets: torch.Tensor, case: Case) -> None:
    """Pyramid and head-prior budgets: this layer's entry of a whole-model allocation that keeps
    ``L * H_kv * b`` entries per row, every head between its window and its row's length."""
    state, tokens = case.state, case.tokens
    h, n_layers = state.num_kv_heads, state.num_layers
    if isinstance(method.budgets, Pyramid):
        per_layer = method.budgets.layer_budgets(tokens, state.lengths, state.window, n_layers)
        assert torch.equal(budgets, per_layer[:, state.layer_idx, None].expand(-1, h))
        assert bool((per_layer[:, 1:] <= per_layer[:, :-1]).all()), "pyramid budgets grow with depth"
        model = per_layer[:, :, None].expand(-1, -1, h)
    else:
        assert isinstance(method.budgets, HeadPrior)
        model = method.budgets.model_budgets(tokens, state.lengths, state.window, n_layers, h)
        assert torch.equal(budgets, model[:, state.layer_idx])
    assert torch.equal(model.sum((1, 2)), n_layers * h * tokens)
    assert bool((model >= state.window).all())
    assert bool((model <= state.lengths[:, None, None]).all())
    if n_layers == 1:
        assert torch.equal(budgets.sum(-1), h * tokens)
