"""TOVA, KeyDiff and Expected Attention against loop-based references of their definitions, their
RoPE handling on real models; against kvpress's presses: tests/bench/test_kvpress_agreement.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import criticalkv as ckv
from criticalkv.scores import ExpectedAttention, KeyDissimilarity, LastQueryAttention
from criticalkv.scores.rope import rope_frequencies, unrotate
from tests.conftest import make_tiny, padded_batch
from tests.helpers.random_state import one_thread, random_state, with_all_queries
from tests.helpers.reference_scores import expected_attention_reference, keydiff_reference, tova_reference

SETTINGS = settings(max_examples=25, deadline=None)


@st.composite
def states(draw: st.DrawFn) -> ckv.LayerState:
    window = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(window + 5, 24), min_size=1, max_size=3))
    state = random_state(
        draw(st.integers(0, 2**16)),
        lengths=lengths,
        num_kv_heads=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([2, 4, 8])),
        window=window,
    )
    return with_all_queries(state, seed=len(lengths))


def _close(ours: torch.Tensor, ref: torch.Tensor, state: ckv.LayerState) -> None:
    real = state.valid[:, None, :].expand_as(ours)
    torch.testing.assert_close(ours.double()[real], ref[real], rtol=2e-4, atol=1e-6)


@SETTINGS
@given(state=states(), heads=st.sampled_from(["all", "group"]))
def test_tova_matches_the_reference(state: ckv.LayerState, heads: str) -> None:
    with one_thread():
        _close(LastQueryAttention(heads=heads)(state), tova_reference(state, heads), state)  # type: ignore[arg-type]


@SETTINGS
@given(state=states())
def test_keydiff_matches_the_reference(state: ckv.LayerState) -> None:
    with one_thread():
        _close(KeyDissimilarity()(state), keydiff_reference(state), state)


@SETTINGS
@given(
    state=states(),
    future=st.integers(1, 6),
    sinks=st.integers(0, 3),
    covariance=st.booleans(),
    value_norm=st.booleans(),
)
def test_expected_attention_matches_the_reference(
    state: ckv.LayerState, future: int, sinks: int, covariance: bool, value_norm: bool
) -> None:
    scorer = ExpectedAttention(future=future, sinks=sinks, covariance=covariance, value_norm=value_norm, eps=1e-3)
    ref = expected_attention_reference(
        state, future=future, sinks=sinks, covariance=covariance, value_norm=value_norm, eps=1e-3
    )
    with one_thread():
        _close(scorer(state), ref, state)


def test_tova_ranks_every_head_of_a_layer_alike() -> None:
    state = random_state(3, lengths=[20, 13], num_kv_heads=3, group=2, head_dim=4, window=2)
    scores = LastQueryAttention()(state)
    assert torch.equal(scores, scores[:, :1].expand_as(scores))
    assert not torch.equal(*LastQueryAttention(heads="group")(state)[0, :2])


def test_keydiff_ignores_key_lengths() -> None:
    state = random_state(4, lengths=[16], num_kv_heads=2, group=1, head_dim=4, window=2)
    scaled = ckv.LayerState(**{**state.__dict__, "keys": state.keys * torch.rand(1, 2, 16, 1) * 5 + 0, "memo": {}})
    torch.testing.assert_close(KeyDissimilarity()(state), KeyDissimilarity()(scaled), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.no_grad()
def test_unrotate_recovers_the_models_pre_rope_queries(arch: str) -> None:
    """Undoing RoPE on the captured queries gives ``q_proj``'s output (left padding included)."""
    model = make_tiny(arch)
    ids, mask = padded_batch([30, 21], seed=2)
    pre: list[torch.Tensor] = []
    attention = model.model.layers[0].self_attn
    hook = attention.q_proj.register_forward_hook(lambda _m, _i, out: pre.append(out))
    try:
        states, _ = ckv.runtime.capture_prefill(model, ids, mask, window=4, num_queries="all")  # type: ignore[arg-type]
    finally:
        hook.remove()
    state = states[0]
    b, h_q, t, d = state.queries.shape
    expected = pre[0].view(b, t, h_q, d).transpose(1, 2)
    inv_freq, scale = rope_frequencies(state.module, d, state.keys.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    undone = unrotate(state.queries.float(), positions[:, None, :], inv_freq, scale)
    real = mask.bool()[:, None, :, None].expand_as(undone)
    torch.testing.assert_close(undone[real], expected.float()[real], rtol=1e-4, atol=1e-4)


def test_expected_attention_needs_a_rope_config() -> None:
    state = with_all_queries(random_state(5, lengths=[12], num_kv_heads=1, group=1, head_dim=4, window=2))
    del state.module.config
    with pytest.raises(ValueError, match="RoPE"):
        ExpectedAttention()(state)


def test_expected_attention_needs_every_prompt_query() -> None:
    state = random_state(6, lengths=[12], num_kv_heads=1, group=1, head_dim=4, window=2)
    with pytest.raises(ValueError, match="every prompt query"):
        ExpectedAttention()(state)
    assert ckv.get_method("expected-attention").needs.queries == "all"


@pytest.mark.parametrize("name", ["future", "sinks"])
def test_expected_attention_rejects_bad_options(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ExpectedAttention(**{name: -1})
    with pytest.raises(ValueError, match="heads"):
        LastQueryAttention(heads="some")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "scorer"),
    [("critical-tova", LastQueryAttention()), ("critical-expected-attention", ExpectedAttention(value_norm=False))],
)
def test_critical_variants_compose_the_same_scores(name: str, scorer: object) -> None:
    method = ckv.get_method(name)
    assert method.scores == scorer
    assert isinstance(method.select, ckv.select.Critical)
    assert method.budgets == ckv.get_method(name.removeprefix("critical-")).budgets
