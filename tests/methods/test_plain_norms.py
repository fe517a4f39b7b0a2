"""The plain ``||V||`` ablation of the Critical selection: the projected rule with ``W_O`` = identity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import criticalkv as ckv
from criticalkv.scores.value_norms import plain_value_norms, projected_value_norms
from criticalkv.select.critical import Critical
from criticalkv.state import LayerState
from tests.helpers.random_state import random_state


def _identity_projection(num_query_heads: int, head_dim: int) -> nn.Linear:
    """An ``o_proj`` whose every head block ``W_O^h`` is the d x d identity."""
    layer = nn.Linear(num_query_heads * head_dim, head_dim, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(head_dim).repeat(1, num_query_heads))
    return layer


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), h_kv=st.integers(1, 3), group=st.integers(1, 3), p=st.sampled_from([1, 2]))
def test_plain_norms_are_the_projected_norms_through_an_identity(seed: int, h_kv: int, group: int, p: int) -> None:
    state = random_state(seed, lengths=[9, 6], num_kv_heads=h_kv, group=group, head_dim=4, window=2)
    values = state.values.clamp(-5, 5)
    identity = _identity_projection(h_kv * group, 4).weight
    torch.testing.assert_close(plain_value_norms(values, p=p), projected_value_norms(values, identity, p=p))
    by_hand = values.double().abs().sum(-1) if p == 1 else values.double().pow(2).sum(-1).sqrt()
    torch.testing.assert_close(plain_value_norms(values, p=p).double(), by_hand, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["critical-snapkv", "critical-adakv"])
@pytest.mark.parametrize("seed", range(4))
def test_unprojected_selection_is_the_selection_with_an_identity_w_o(method: str, seed: int) -> None:
    def state() -> LayerState:
        return random_state(seed, lengths=[40, 31], num_kv_heads=2, group=3, head_dim=8, window=4)

    tokens = torch.tensor([12, 12])
    plain = ckv.get_method(method, projected=False, precision="exact").keep_mask(state(), tokens)
    identity_state = state()
    identity_state.module.o_proj = _identity_projection(6, 8)
    projected = ckv.get_method(method, precision="exact").keep_mask(identity_state, tokens)
    assert torch.equal(plain, projected)


def test_the_real_projection_changes_the_selection_somewhere() -> None:
    tokens = torch.tensor([12, 12])
    differ = 0
    for seed in range(8):
        state = random_state(seed, lengths=[40, 31], num_kv_heads=2, group=3, head_dim=8, window=4)
        plain = ckv.get_method("critical-snapkv", projected=False).keep_mask(state, tokens)
        projected = ckv.get_method("critical-snapkv").keep_mask(state, tokens)
        differ += int(not torch.equal(plain, projected))
    assert differ > 0


def test_projected_option_is_validated() -> None:
    assert ckv.get_method("critical-snapkv").options()["projected"] is True
    with pytest.raises(TypeError, match="projected"):
        Critical(projected="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="projected=False"):
        Critical(p=2, gram=True, projected=False)
