"""The Gram-form L2 criterion equals the direct L2 projection ``||v W_O^h||_2``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import criticalkv as ckv
from criticalkv.scores.value_norms import gram_value_norms, projected_value_norms
from criticalkv.select.critical import Critical
from tests.random_state import o_proj_weight, random_state


def _loop_l2(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """||v W_O^h||_2 per query head from its definition (float64), GQA group mean."""
    b, h_kv, t, d = values.shape
    g = weight.shape[1] // d // h_kv
    out = torch.zeros(b, h_kv, t, dtype=torch.float64)
    for kv in range(h_kv):
        for j in range(g):
            block = weight[:, (kv * g + j) * d : (kv * g + j + 1) * d].double().T  # W_O^h, (d, D)
            out[:, kv] += (values[:, kv].double() @ block).norm(dim=-1) / g
    return out


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    h_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.sampled_from([2, 4, 8]),
    hidden=st.integers(3, 24),
)
def test_gram_norms_equal_the_direct_l2_projection(seed: int, h_kv: int, group: int, d: int, hidden: int) -> None:
    state = random_state(seed, lengths=[9, 6], num_kv_heads=h_kv, group=group, head_dim=d, window=2, hidden=hidden)
    weight = o_proj_weight(state)
    values = state.values.clamp(-5, 5)
    gram = gram_value_norms(values, weight)
    torch.testing.assert_close(gram.double(), _loop_l2(values, weight), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gram, projected_value_norms(values, weight, p=2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(5))
def test_critical_with_gram_keeps_what_the_direct_l2_keeps(seed: int) -> None:
    state = random_state(seed, lengths=[40, 31], num_kv_heads=2, group=3, head_dim=8, window=4)
    tokens = torch.tensor([12, 12])
    direct = ckv.get_method("critical-snapkv", p=2, precision="exact")
    gram = ckv.get_method("critical-snapkv", p=2, gram=True, precision="exact")
    assert torch.equal(direct.keep_mask(state, tokens), gram.keep_mask(state, tokens))


def test_gram_needs_the_l2_norm() -> None:
    with pytest.raises(ValueError, match="p=2"):
        Critical(gram=True)
