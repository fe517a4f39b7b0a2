"""DefensiveKV and Layer-DefensiveKV (Feng et al. 2025, arXiv 2510.13334): loop-based references of
the defensive aggregation, the adaptive stage 1 and the joint selection, invariants, and the caches'
deferred cross-layer compression."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import criticalkv as ckv
from criticalkv.budgets import Adaptive, LayerJoint
from criticalkv.cache.batch import row_kv_bytes, stacked_cache
from criticalkv.cli import main
from criticalkv.prompts import positions
from criticalkv.scores import DefensiveAggregation
from criticalkv.select import AdaptiveCritical
from criticalkv.select.adaptive_critical import FORCED
from criticalkv.state import LayerState
from tests.conftest import make_tiny, padded_batch
from tests.helpers.naive_reference import eligible_positions, naive_value_norms, naive_window_attention
from tests.helpers.random_state import o_proj_weight, random_state
from tests.helpers.selection_cases import assert_valid_selection
from tests.methods.test_reference_critical import CASES as REFERENCE_CASES

KERNEL, THRESHOLD = 5, 0.9

# (seed, lengths, H_kv, G, head_dim, window, budget): the first cases of the CriticalKV reference tests
CASES = REFERENCE_CASES[:6]


def make_state(case: tuple, layer: int = 0, num_layers: int = 1, sharpness: float = 1.0) -> LayerState:
    seed, lengths, h_kv, group, d, window, _ = case
    state = random_state(seed + 100 * layer, lengths=lengths, num_kv_heads=h_kv, group=group, head_dim=d, window=window)
    # sharper queries give peakier attention, so stage 1 reaches its threshold before its cap
    return LayerState(
        **{**state.__dict__, "queries": state.queries * sharpness, "layer_idx": layer, "num_layers": num_layers}
    )


def tokens_for(case: tuple, state: LayerState) -> torch.Tensor:
    return ckv.resolve_budget(case[-1], state.lengths, state.window)


def method(threshold: float = THRESHOLD, joint: bool = False, correction: bool = True) -> ckv.Method:
    return ckv.Method(
        "test",
        "",
        "",
        DefensiveAggregation(),
        budgets=LayerJoint() if joint else Adaptive(0.0),
        select=AdaptiveCritical(threshold=threshold, window_correction=correction, precision="exact"),
    )


# --- naive references ----------------------------------------------------------------------------


def naive_defensive(state: LayerState, kernel: int = KERNEL) -> torch.Tensor:
    """(B, H_kv, T) float64: per window query softmax, mass-preserving avg pool over the real
    non-window tokens, max over the group's query heads and the window queries, floor at the mean."""
    b, h_kv, t, _ = state.keys.shape
    w, g = state.window, state.group_size
    body = t - w
    q, k = state.queries[:, :, -w:].double(), state.keys.double()
    out = torch.zeros(b, h_kv, t, dtype=torch.float64)
    half = kernel // 2
    for row in range(b):
        real = [i for i in range(body) if bool(state.valid[row, i])]
        for kv in range(h_kv):
            worst = [0.0] * body
            for hq in range(kv * g, (kv + 1) * g):
                for j in range(w):
                    position = t - w + j
                    allowed = [i for i in range(t) if bool(state.valid[row, i]) and i <= position]
                    logits = torch.stack([q[row, hq, j] @ k[row, kv, i] for i in allowed]) * state.scaling
                    weights = dict(zip(allowed, torch.softmax(logits, dim=0).tolist(), strict=True))
                    attn = [weights.get(i, 0.0) for i in range(body)]
                    pooled = [sum(attn[max(0, i - half) : i + half + 1]) / kernel for i in range(body)]
                    mass = sum(attn[i] for i in real)
                    total = sum(pooled[i] for i in real)
                    for i in real:
                        worst[i] = max(worst[i], pooled[i] * mass / total if total > 0 else 0.0)
            mean = sum(worst[i] for i in real) / len(real) if real else 0.0
            for i in real:
                out[row, kv, i] = max(worst[i], mean)
    return out


def naive_stage1(
    state: LayerState, tokens: torch.Tensor, threshold: float = THRESHOLD, correction: bool = True
) -> dict[tuple[int, int], list[int]]:
    """Per (row, KV head), the stage-1 positions: by mean window attention until the kept mass,
    window included, reaches the threshold (or ``threshold`` of the non-window mass), at most b - w."""
    attention = naive_window_attention(state, kernel=1)  # the raw window mean, window columns included
    t, w = state.seq_len, state.window
    out = {}
    for row in range(state.batch_size):
        for head in range(state.num_kv_heads):
            a = attention[row, head].tolist()
            window_mass = sum(a[t - w :])
            need = threshold - window_mass if correction else threshold * (1.0 - window_mass)
            order = sorted(eligible_positions(state, row), key=lambda i: -a[i])
            taken: list[int] = []
            mass = 0.0
            for i in order:
                if mass >= need:
                    break
                taken.append(i)
                mass += a[i]
            out[(row, head)] = taken[: max(int(tokens[row]) - w, 0)]
    return out


def naive_defensive_keep(
    states: list[LayerState], tokens: torch.Tensor, threshold: float = THRESHOLD, joint: bool = False
) -> list[torch.Tensor]:
    """DefensiveKV (``joint=False``: per layer) or Layer-DefensiveKV, entry by entry: every stage-1
    entry and window, then the highest defensive score x norm share over the layer's (or all
    layers') remaining entries."""
    keeps = [torch.zeros(s.batch_size, s.num_kv_heads, s.seq_len, dtype=torch.bool) for s in states]
    t, w = states[0].seq_len, states[0].window
    weighted, forced = [], []
    for state in states:
        scores = naive_defensive(state)
        norms = naive_value_norms(state.values, o_proj_weight(state))
        shares = norms / norms.sum(dim=1, keepdim=True)
        weighted.append(scores * shares)
        forced.append(naive_stage1(state, tokens, threshold))
    groups = [list(range(len(states)))] if joint else [[layer] for layer in range(len(states))]
    for row in range(states[0].batch_size):
        h = states[0].num_kv_heads
        for group in groups:
            taken: set[tuple[int, int, int]] = set()
            for layer in group:
                for head in range(h):
                    taken.update((layer, head, i) for i in forced[layer][(row, head)])
            rest = [
                (layer, head, i)
                for layer in group
                for head in range(h)
                for i in eligible_positions(states[layer], row)
                if (layer, head, i) not in taken
            ]
            rest.sort(key=lambda e: -float(weighted[e[0]][row, e[1], e[2]]))
            room = len(group) * h * (int(tokens[row]) - w) - len(taken)
            taken.update(rest[:room])
            for layer, head, i in taken:
                keeps[layer][row, head, i] = True
            for layer in group:
                keeps[layer][row, :, t - w :] = True
    return keeps


def assert_same_choice(ours: list[torch.Tensor], ref: list[torch.Tensor], ranked: list[torch.Tensor]) -> None:
    """The same per-head counts and the same chosen ranking values: equal up to ties (with one KV head
    the norm shares are all 1, and entries clamped at the head's mean tie)."""
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.sum(-1), b.sum(-1))
    for row in range(ours[0].shape[0]):
        mine = torch.cat([r[row][a[row]] for a, r in zip(ours, ranked, strict=True)]).sort().values
        theirs = torch.cat([r[row][b[row]] for b, r in zip(ref, ranked, strict=True)]).sort().values
        assert torch.allclose(mine, theirs, rtol=1e-5, atol=0.0)


# --- the defensive aggregation -------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_defensive_aggregation_matches_naive(case: tuple) -> None:
    state = make_state(case)
    ours = DefensiveAggregation()(state).double()
    ref = naive_defensive(state)
    eligible = state.eligible
    assert ours.shape == ref.shape
    assert torch.allclose(ours[eligible], ref[eligible], atol=1e-6, rtol=1e-5)


def test_defensive_aggregation_without_pooling_is_the_floored_max() -> None:
    state = make_state(CASES[1])
    ours = DefensiveAggregation(kernel=1)(state).double()
    assert torch.allclose(ours[state.eligible], naive_defensive(state, kernel=1)[state.eligible], atol=1e-6)


def test_defensive_aggregation_is_the_worst_case_not_the_mean() -> None:
    """Above the mean-of-window scores wherever one query disagrees; never below the head's mean."""
    state = make_state(CASES[0])
    worst = DefensiveAggregation(kernel=1)(state)
    mean = ckv.scores.WindowAttention(pool="none")(state)
    eligible = state.eligible
    assert bool((worst[eligible] >= mean[eligible] - 1e-7).all())
    raw = torch.zeros_like(worst)
    raw[..., : state.seq_len - state.window] = DefensiveAggregation(kernel=1).per_query_attention(state).amax((2, 3))
    floor = (raw * eligible).sum(-1) / eligible.sum(-1)  # the mean of the unclamped maxima
    assert torch.allclose(worst.masked_fill(~eligible, math.inf).amin(-1), floor)
    at_floor = torch.isclose(worst, floor[..., None]) & eligible
    assert bool(at_floor.sum(-1).ge(2).all())  # the clamp binds


def test_a_padded_row_scores_as_it_would_alone() -> None:
    state = make_state(CASES[1])  # rows of 33, 40 and 21 tokens in 40 columns
    scores = DefensiveAggregation()(state)
    for row, n in enumerate(state.lengths.tolist()):
        alone = LayerState(
            **{
                **state.__dict__,
                "queries": state.queries[row : row + 1],
                "keys": state.keys[row : row + 1, :, -n:],
                "values": state.values[row : row + 1, :, -n:],
                "valid": state.valid[row : row + 1, -n:],
                "memo": {},
            }
        )
        assert torch.allclose(DefensiveAggregation()(alone)[0], scores[row, :, -n:], atol=1e-6)


@pytest.mark.parametrize("kernel", [0, 4, -1, True, 2.0])
def test_defensive_aggregation_rejects_bad_kernels(kernel: object) -> None:
    with pytest.raises(ValueError, match="kernel must be a positive odd integer"):
        DefensiveAggregation(kernel=kernel)  # type: ignore[arg-type]


# --- the adaptive stage 1 ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("threshold", [0.9, 0.5, 0.2])
@pytest.mark.parametrize("correction", [True, False])
def test_stage1_matches_naive(case: tuple, threshold: float, correction: bool) -> None:
    state = make_state(case, sharpness=3.0)
    tokens = tokens_for(case, state)
    ours = AdaptiveCritical(threshold=threshold, window_correction=correction).stage1(state, tokens)
    ref = naive_stage1(state, tokens, threshold, correction)
    for (row, head), positions_ in ref.items():
        assert sorted(ours[row, head].nonzero()[:, 0].tolist()) == sorted(positions_), (row, head)


def test_stage1_counts_the_window_mass() -> None:
    """Stage 1 keeps the fewest entries that bring the head's mass, window included, to the threshold."""
    state = make_state(CASES[4], sharpness=3.0)
    tokens = torch.tensor([60, 45])  # no cap
    select = AdaptiveCritical(threshold=0.6)
    attention = ckv.scores.WindowAttention(pool="none")(state).double()
    forced = select.stage1(state, tokens)
    window = state.window_mask.expand_as(forced)
    kept = (attention * (forced | window)).sum(-1)
    last = torch.where(forced, attention, torch.full_like(attention, math.inf)).amin(-1)
    needed = (attention * window).sum(-1) < 0.6
    assert bool((kept[needed] >= 0.6 - 1e-6).all())
    assert bool((kept - last < 0.6)[needed & forced.any(-1)].all())  # one entry fewer would not do
    assert not bool(forced[~needed].any())  # the window alone holds the threshold: nothing forced


def test_stage1_ignores_a_window_that_holds_the_mass() -> None:
    """Queries that attend only to the window: the corrected stage 1 forces nothing, the uncorrected
    one (and the released code, which measures the tokens before the window) still forces entries."""
    base = make_state(CASES[0])
    queries = torch.ones_like(base.queries)
    keys = torch.zeros_like(base.keys)  # logit 0 outside the window
    keys[:, :, -base.window :] = 8.0 / math.sqrt(base.head_dim)  # logit 8 on the window
    keys[:, :, 0] = 2.0 / math.sqrt(base.head_dim)  # one token outside stands out a little
    state = LayerState(**{**base.__dict__, "queries": queries, "keys": keys, "memo": {}})
    attention = ckv.scores.WindowAttention(pool="none")(state)
    assert bool(((attention * state.window_mask).sum(-1) > 0.9).all())
    tokens = torch.tensor([20])
    assert not bool(AdaptiveCritical().stage1(state, tokens).any())
    assert bool(AdaptiveCritical(window_correction=False).stage1(state, tokens).any())


def test_stage1_is_capped_at_the_budget_outside_the_window() -> None:
    state = make_state(CASES[1])
    tokens = tokens_for(CASES[1], state)
    forced = AdaptiveCritical(threshold=1.0).stage1(state, tokens)
    assert torch.equal(forced.sum(-1), (tokens - state.window)[:, None].expand(-1, state.num_kv_heads))
    assert not bool(AdaptiveCritical(threshold=0.0).stage1(state, tokens).any())


@pytest.mark.parametrize("threshold", [-0.1, 1.5, math.nan, True])
def test_adaptive_critical_rejects_bad_thresholds(threshold: float) -> None:
    with pytest.raises(ValueError, match="threshold must be an attention mass"):
        AdaptiveCritical(threshold=threshold)
    with pytest.raises(ValueError, match="precision must be one of"):
        AdaptiveCritical(precision="float8")


def test_rank_puts_stage1_first_and_weights_the_rest_by_norm_shares() -> None:
    state = make_state(CASES[0], sharpness=3.0)
    tokens = tokens_for(CASES[0], state)
    m = method()
    assert isinstance(m.select, AdaptiveCritical)
    ranked = m.ranked_scores(state, tokens)
    forced = m.select.stage1(state, tokens)
    assert bool((ranked[forced] >= FORCED).all()) and bool((ranked[~forced & state.eligible] < 1.0).all())
    assert bool((ranked[~state.eligible] == -math.inf).all())
    scores = DefensiveAggregation()(state).double()
    norms = naive_value_norms(state.values, o_proj_weight(state))
    expected = scores * norms / norms.sum(dim=1, keepdim=True)
    rest = ~forced & state.eligible
    assert torch.allclose(ranked.double()[rest], expected[rest], rtol=1e-4, atol=1e-7)


# --- whole methods against the naive selection ---------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("threshold", [0.9, 0.3])
def test_defensivekv_matches_naive(case: tuple, threshold: float) -> None:
    state = make_state(case, sharpness=3.0)
    tokens = tokens_for(case, state)
    m = method(threshold)
    keep = m.keep_mask(state, tokens)
    ref = naive_defensive_keep([state], tokens, threshold)
    assert_same_choice([keep], ref, [m.ranked_scores(state, tokens)])
    if state.num_kv_heads > 1:
        assert torch.equal(keep, ref[0])
    registered = ckv.get_method("defensivekv")  # the same parts (its norms in the default precision)
    assert (registered.scores, registered.budgets) == (DefensiveAggregation(), Adaptive(0.0))
    assert registered.select == AdaptiveCritical()


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("threshold", [0.9, 0.3])
def test_layer_defensivekv_matches_naive(case: tuple, threshold: float) -> None:
    layers = 3
    states = [make_state(case, layer, layers, sharpness=1.0 + layer) for layer in range(layers)]
    tokens = tokens_for(case, states[0])
    m = method(threshold, joint=True)
    keeps = m.keep_masks(states, tokens)
    ref = naive_defensive_keep(states, tokens, threshold, joint=True)
    assert_same_choice(keeps, ref, [m.ranked_scores(s, tokens) for s in states])
    if states[0].num_kv_heads > 1:
        for ours, theirs in zip(keeps, ref, strict=True):
            assert torch.equal(ours, theirs)


def test_layer_joint_on_one_layer_is_pooling_over_its_heads() -> None:
    state = make_state(CASES[4], sharpness=2.0)
    tokens = tokens_for(CASES[4], state)
    scores = ckv.get_method("layer-defensivekv").ranked_scores(state, tokens)
    assert torch.equal(LayerJoint()(scores, state, tokens), Adaptive(0.0)(scores, state, tokens))
    assert torch.equal(
        ckv.get_method("layer-defensivekv").keep_mask(state, tokens),
        ckv.get_method("defensivekv").keep_mask(state, tokens),
    )


def test_layer_joint_refuses_states_of_different_prompts() -> None:
    a, b = make_state(CASES[1]), make_state(CASES[0])
    with pytest.raises(ValueError, match="states of one prompt"):
        LayerJoint().joint([torch.zeros(3, 2, 40), torch.zeros(1, 2, 40)], [a, b], torch.tensor([20, 20, 10]))


# --- invariants ----------------------------------------------------------------------------------

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None)


@st.composite
def layered_cases(draw: st.DrawFn) -> tuple[list[LayerState], torch.Tensor]:
    window = draw(st.integers(1, 5))
    batch = draw(st.integers(1, 3))
    longest = draw(st.integers(window, 36))
    lengths = [draw(st.integers(window, longest)) for _ in range(batch - 1)] + [longest]
    h_kv, group, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([2, 4]))
    layers = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    zero = draw(st.booleans())  # zero keys and values: ties everywhere
    states = []
    for layer in range(layers):
        s = random_state(
            seed + layer,
            lengths=lengths,
            num_kv_heads=h_kv,
            group=group,
            head_dim=d,
            window=window,
            zero_keys=zero,
            zero_values=zero,
        )
        sharp = draw(st.sampled_from([0.5, 1.0, 4.0]))
        states.append(
            LayerState(**{**s.__dict__, "queries": s.queries * sharp, "layer_idx": layer, "num_layers": layers})
        )
    budget = draw(st.integers(window, min(lengths)))
    return states, ckv.resolve_budget(budget, states[0].lengths, window)


@SETTINGS
@given(case=layered_cases(), threshold=st.sampled_from([0.9, 0.5, 1.0]))
def test_joint_and_per_layer_invariants(case: tuple[list[LayerState], torch.Tensor], threshold: float) -> None:
    states, tokens = case
    h, n_layers = states[0].num_kv_heads, len(states)
    for joint in (False, True):
        m = method(threshold, joint=joint)
        keeps = m.keep_masks(states, tokens)
        kept = torch.stack([k.sum(-1) for k in keeps], dim=1)  # (B, L, H)
        assert torch.equal(kept.sum((1, 2)), n_layers * h * tokens)  # the same total either way
        assert bool((kept >= states[0].window).all())
        assert bool((kept <= states[0].lengths[:, None, None]).all())
        if not joint:
            assert torch.equal(kept.sum(-1), h * tokens[:, None].expand(-1, n_layers))
        for keep, state in zip(keeps, states, strict=True):
            assert_valid_selection(keep, keep.sum(-1), state)
            forced = AdaptiveCritical(threshold=threshold).stage1(state, tokens)
            assert not bool((forced & ~keep).any()), "a stage-1 entry was evicted"


# --- the caches ----------------------------------------------------------------------------------


@torch.no_grad()
def test_caches_compress_layer_defensivekv_alike_and_exactly() -> None:
    """In flight (deferred to the last layer), from captured states and stacked: the same masks,
    the same total as the per-layer method, and bytes equal to the kept entries."""
    model = ckv.attach(make_tiny("llama"))
    ids, mask = padded_batch([52, 41], seed=5)
    pos = positions(mask)
    inflight = ckv.CompressedCache.for_model(model, "layer-defensivekv", 0.3, window=5)
    seen: list[int] = []

    compress = inflight.compressed_layers[0].on_prefill  # the cache's own hook, shared by its layers
    assert compress is not None

    def spy(layer: ckv.cache.CompressedLayer, *args: object) -> None:
        seen.append(sum(other.holds_prompt for other in inflight.compressed_layers))
        compress(layer, *args)

    for layer in inflight.compressed_layers:
        layer.on_prefill = spy
    model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=inflight)
    assert seen == [0, 0, 0]  # nothing is compressed before the last layer has been seen
    states, _ = ckv.prefill(model, ids, mask, window=5)
    derived = ckv.CompressedCache.from_states(states, "layer-defensivekv", 0.3)
    per_layer = ckv.CompressedCache.from_states(states, "defensivekv", 0.3)
    for a, b in zip(inflight.keep_masks(), derived.keep_masks(), strict=True):
        assert torch.equal(a, b)
    kept = inflight.kept_entries()  # (L, B, H)
    assert torch.equal(kept.sum((0, 2)), per_layer.kept_entries().sum((0, 2)))
    layer = inflight.compressed_layers[0]
    entry = 2 * layer.head_dim * torch.empty((), dtype=layer.dtype).element_size()
    assert inflight.kv_bytes() == int(kept.sum()) * entry
    for row, n in enumerate([52, 41]):
        one, one_mask = ids[row : row + 1, -n:], mask[row : row + 1, -n:]
        row_states, _ = ckv.prefill(model, one, one_mask, window=5)
        specs = [ckv.CacheSpec.of("full", 1.0, 5), ckv.CacheSpec.of("layer-defensivekv", 0.3, 5)]
        stacked, _ = stacked_cache(row_states, specs)
        alone = ckv.CompressedCache.from_states(row_states, "layer-defensivekv", 0.3)
        for keep, ref in zip(stacked.keep_masks(), alone.keep_masks(), strict=True):
            assert torch.equal(keep[1], ref[0])
        assert row_kv_bytes(stacked)[1] == alone.kv_bytes() == int(alone.kept_entries().sum()) * entry


def test_methods_command_describes_defensivekv(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    for name in ("defensivekv", "layer-defensivekv"):
        assert "arXiv 2510.13334" in lines[name]
    assert ckv.get_method("layer-defensivekv").cross_layer and not ckv.get_method("defensivekv").cross_layer
