"""CriticalKV against a direct, loop-based reading of ALGORITHM.md.

Everything here is written the slow way (Python loops over rows, heads and positions, float64)
so that it shares no code with the library: window attention, pooling, projected value norms,
AdaKV's allocation and the two-stage selection.
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
from tests.random_state import o_proj_weight, random_state
from tests.synthetic_scores import bind_synthetic


def exact(method: ckv.Method) -> ckv.Method:
    """``method`` with its value norms computed in the values' own dtype (float32 here), as the
    float64 references are; the default ``auto`` precision may use bfloat16."""
    return dataclasses.replace(method, select=dataclasses.replace(method.select, precision="exact"))


ALPHA, EPS, KERNEL, ALPHA_FLOOR = 0.5, 1e-4, 5, 0.2

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


def make_state(case: tuple) -> tuple[LayerState, torch.Tensor]:
    seed, lengths, h_kv, group, d, window, budget = case
    state = random_state(seed, lengths=lengths, num_kv_heads=h_kv, group=group, head_dim=d, window=window)
    return state, ckv.resolve_budget(budget, state.lengths, window)


# --- naive building blocks -----------------------------------------------------------------------


def naive_window_attention(state: LayerState, kernel: int = KERNEL) -> torch.Tensor:
    """(B, H_kv, T) float64: softmax per window query, window mean, avg-pool, group mean."""
    b, h_kv, t, _ = state.keys.shape
    w, g = state.window, state.group_size
    q = state.queries[:, :, -w:].double()
    k = state.keys.double()
    per_query_head = torch.zeros(b, h_kv * g, t, dtype=torch.float64)
    for row in range(b):
        for hq in range(h_kv * g):
            kv = hq // g
            for j in range(w):
                position = t - w + j
                allowed = [i for i in range(t) if bool(state.valid[row, i]) and i <= position]
                logits = torch.stack([q[row, hq, j] @ k[row, kv, i] for i in allowed]) * state.scaling
                weights = torch.softmax(logits, dim=0)
                for i, a in zip(allowed, weights.tolist(), strict=True):
                    per_query_head[row, hq, i] += a / w
    pooled = per_query_head.clone()
    half = kernel // 2
    for row in range(b):
        for hq in range(h_kv * g):
            for i in range(t - w):  # the window is not pooled
                lo, hi = max(0, i - half), min(t - w, i + half + 1)
                pooled[row, hq, i] = per_query_head[row, hq, lo:hi].sum() / kernel  # count_include_pad
    out = torch.zeros(b, h_kv, t, dtype=torch.float64)
    for kv in range(h_kv):
        for j in range(g):
            out[:, kv] += pooled[:, kv * g + j] / g
    return out


def naive_value_norms(values: torch.Tensor, weight: torch.Tensor, p: int = 1) -> torch.Tensor:
    """(B, H_kv, T) float64: mean over the group of ||V_i @ W_O^h||_p."""
    b, h_kv, t, d = values.shape
    h_q = weight.shape[1] // d
    g = h_q // h_kv
    out = torch.zeros(b, h_kv, t, dtype=torch.float64)
    for row in range(b):
        for kv in range(h_kv):
            for h in range(kv * g, (kv + 1) * g):
                w_o = weight[:, h * d : (h + 1) * d].T.double()  # (d, D)
                for i in range(t):
                    projected = values[row, kv, i].double() @ w_o
                    norm = projected.abs().sum() if p == 1 else projected.norm()
                    out[row, kv, i] += norm / g
    return out


def eligible_positions(state: LayerState, row: int) -> list[int]:
    t, w = state.seq_len, state.window
    return [i for i in range(t - w) if bool(state.valid[row, i])]


def ranked(candidates: list[int], key: list[float]) -> list[int]:
    return sorted(candidates, key=lambda i: -key[i])


def naive_adakv_budgets(
    scores: torch.Tensor, state: LayerState, budget: torch.Tensor, alpha_floor: float = ALPHA_FLOOR
) -> torch.Tensor:
    """Per row: each head's safeguard by its own scores, then the global top across heads."""
    b, h, _ = scores.shape
    w = state.window
    out = torch.zeros(b, h, dtype=torch.long)
    for row in range(b):
        per_head = int(budget[row])
        safeguard = max(1, math.floor(alpha_floor * per_head))
        taken: set[tuple[int, int]] = set()
        for head in range(h):
            order = ranked(eligible_positions(state, row), scores[row, head].tolist())
            taken.update((head, i) for i in order[: min(max(safeguard - w, 0), per_head - w)])
        candidates = eligible_positions(state, row)
        rest = [(head, i) for head in range(h) for i in candidates if (head, i) not in taken]
        rest.sort(key=lambda hi: -float(scores[row, hi[0], hi[1]]))
        taken.update(rest[: h * (per_head - w) - len(taken)])
        for head in range(h):
            out[row, head] = w + sum(1 for hh, _ in taken if hh == head)
    return out


def naive_critical(
    attention: torch.Tensor,
    norms: torch.Tensor,
    budgets: torch.Tensor,
    state: LayerState,
    alpha: float = ALPHA,
) -> torch.Tensor:
    """The two-stage selection, one (row, head) at a time."""
    b, h, t = attention.shape
    w = state.window
    keep = torch.zeros(b, h, t, dtype=torch.bool)
    for row in range(b):
        for head in range(h):
            b_h = int(budgets[row, head])
            a = attention[row, head].tolist()
            weighted = [(a[i] + EPS) * float(norms[row, head, i]) for i in range(t)]
            candidates = eligible_positions(state, row)
            stage1 = ranked(candidates, a)[: max(math.floor(alpha * b_h) - w, 0)]
            remaining = [i for i in candidates if i not in stage1]
            stage2 = ranked(remaining, weighted)[: b_h - w - len(stage1)]
            for i in [*stage1, *stage2, *range(t - w, t)]:
                keep[row, head, i] = True
    return keep


# --- comparisons ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_window_attention_matches_naive(case: tuple) -> None:
    state, _ = make_state(case)
    ours = WindowAttention()(state).double()
    ref = naive_window_attention(state)
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-5)  # padding too: zero, then pooled


@pytest.mark.parametrize("case", CASES[:3])
def test_window_attention_without_pooling_is_the_raw_window_mean(case: tuple) -> None:
    state, _ = make_state(case)
    ours = WindowAttention(pool="none")(state).double()
    assert torch.allclose(ours, naive_window_attention(state, kernel=1), atol=1e-6)
    # each window query's weights sum to one over the real tokens, so their mean does too
    assert torch.allclose(ours.sum(-1), torch.ones(ours.shape[:2], dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("tokens_per_chunk", [None, 1, 3, 7])
def test_projected_value_norms_match_naive(case: tuple, p: int, tokens_per_chunk: int | None) -> None:
    state, _ = make_state(case)
    weight = o_proj_weight(state)
    b, h_kv, t, _ = state.values.shape
    kwargs = {}
    if tokens_per_chunk is not None:  # the (B, H_q, chunk, D) float32 temporary holds this many tokens
        kwargs["max_chunk_bytes"] = tokens_per_chunk * b * state.num_query_heads * weight.shape[0] * 4
    ours = projected_value_norms(state.values, weight, p=p, **kwargs)
    ref = naive_value_norms(state.values, weight, p=p)
    assert ours.dtype == torch.float32 and ours.shape == (b, h_kv, t)
    assert torch.allclose(ours.double(), ref, rtol=1e-4, atol=1e-4)


def test_projected_value_norms_tiny_chunk_budget() -> None:
    """A byte bound below one token's temporary still works (one token per chunk)."""
    state, _ = make_state(CASES[4])
    weight = o_proj_weight(state)
    whole = projected_value_norms(state.values, weight)
    assert torch.allclose(projected_value_norms(state.values, weight, max_chunk_bytes=1), whole)


@pytest.mark.parametrize("case", CASES)
def test_critical_snapkv_matches_naive(case: tuple) -> None:
    state, tokens = make_state(case)
    keep = exact(ckv.get_method("critical-snapkv")).keep_mask(state, tokens)
    attention = naive_window_attention(state)
    norms = naive_value_norms(state.values, o_proj_weight(state))
    budgets = tokens[:, None].expand(-1, state.num_kv_heads)
    assert torch.equal(keep, naive_critical(attention, norms, budgets, state))


@pytest.mark.parametrize("case", CASES)
def test_critical_adakv_matches_naive(case: tuple) -> None:
    state, tokens = make_state(case)
    method = exact(ckv.get_method("critical-adakv"))
    assert method.scores is not None
    scores = method.scores(state).float().masked_fill(~state.eligible, float("-inf"))
    budgets = Adaptive(ALPHA_FLOOR)(scores, state, tokens)
    attention = naive_window_attention(state)
    # the library's AdaKV allocation equals the loop version on the naive scores
    assert torch.equal(budgets, naive_adakv_budgets(attention, state, tokens))
    keep = method.keep_mask(state, tokens)
    norms = naive_value_norms(state.values, o_proj_weight(state))
    assert torch.equal(keep, naive_critical(attention, norms, budgets, state))


@pytest.mark.parametrize("case", CASES)
def test_snapkv_and_adakv_match_naive_topk(case: tuple) -> None:
    """The base methods are the same loops with stage 1 taking the whole budget (alpha = 1)."""
    state, tokens = make_state(case)
    attention = naive_window_attention(state)
    norms = naive_value_norms(state.values, o_proj_weight(state))
    uniform = tokens[:, None].expand(-1, state.num_kv_heads)
    adaptive = naive_adakv_budgets(attention, state, tokens)
    snapkv = ckv.get_method("snapkv").keep_mask(state, tokens)
    adakv = ckv.get_method("adakv").keep_mask(state, tokens)
    assert torch.equal(snapkv, naive_critical(attention, norms, uniform, state, alpha=1.0))
    assert torch.equal(adakv, naive_critical(attention, norms, adaptive, state, alpha=1.0))


@pytest.mark.parametrize("case", CASES[1:])
@pytest.mark.parametrize("alpha_floor", [0.2, 0.5])
def test_adakv_allocation_matches_naive_when_the_safeguard_binds(case: tuple, alpha_floor: float) -> None:
    """Heads whose scores differ in scale: the weak heads live on their safeguard."""
    state, tokens = make_state(case)
    g = torch.Generator().manual_seed(case[0])
    scale = 10.0 ** -torch.arange(state.num_kv_heads, dtype=torch.float32)  # 1, 0.1, 0.01, ...
    scores = torch.rand(state.eligible.shape, generator=g) * scale[None, :, None]
    scores = scores.masked_fill(~state.eligible, float("-inf"))
    budgets = Adaptive(alpha_floor)(scores, state, tokens)
    assert torch.equal(budgets, naive_adakv_budgets(scores, state, tokens, alpha_floor))
    if state.num_kv_heads > 1 and max(math.floor(alpha_floor * int(b)) for b in tokens) > state.window:
        assert not torch.equal(budgets, Adaptive(0.0)(scores, state, tokens))  # the safeguard did something


# --- layer-wise and head-prior budgets (PyramidKV, HeadKV) ---------------------------------------


def naive_apportion(shares: list[float], total: int) -> list[int]:
    """Floors, plus one for the largest fractional parts (lower index first on ties)."""
    floors = [math.floor(x) for x in shares]
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in order[: total - sum(floors)]:
        floors[i] += 1
    return floors


def naive_pyramid(budget: int, length: int, window: int, layers: int, beta: float = 20.0) -> list[int]:
    """PyramidKV on b' = b - w: 2b' - b'/beta down to b'/beta, lowered to fit the prompt."""
    sel, cap = budget - window, length - window
    low, high = sel / beta, 2 * sel - sel / beta
    if high > cap:
        high, low = cap, 2 * sel - cap
    shares = [sel] if layers == 1 else [high - (high - low) * layer / (layers - 1) for layer in range(layers)]
    return [window + n for n in naive_apportion(shares, layers * sel)]


def naive_head_prior(scores: list[float], budget: int, length: int, window: int, beta: float) -> list[int]:
    """HeadKV's Eq. 4 on b' = b - w over all heads, capped at the prompt, overflow shared in proportion."""
    sel, cap, heads = budget - window, length - window, len(scores)
    norm = [s / sum(scores) for s in scores]
    shares = [s * (sel / beta) * heads + sel - sel / beta for s in norm]
    fixed: set[int] = set()
    while True:
        free = [i for i in range(heads) if i not in fixed]
        weights = {i: shares[i] for i in free}
        if free and sum(weights.values()) <= 0:
            weights = dict.fromkeys(free, 1.0)
        room = heads * sel - len(fixed) * cap
        fitted = [float(cap) if i in fixed else weights[i] * room / sum(weights.values()) for i in range(heads)]
        over = {i for i in free if fitted[i] > cap}
        if not over:
            break
        fixed |= over
    return [window + n for n in naive_apportion(fitted, heads * sel)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layers", [1, 4])
def test_pyramid_budgets_match_naive(case: tuple, layers: int) -> None:
    state, tokens = make_state(case)
    ours = Pyramid().layer_budgets(tokens, state.lengths, state.window, layers)
    for row in range(state.batch_size):
        expected = naive_pyramid(int(tokens[row]), int(state.lengths[row]), state.window, layers)
        assert ours[row].tolist() == expected


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("beta", [1.0, 1.5, 4.0])
def test_head_prior_budgets_match_naive(case: tuple, beta: float) -> None:
    state, tokens = make_state(case)
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
def test_critical_on_layer_varying_budgets_matches_naive(case: tuple, name: str) -> None:
    """CriticalPyramidKV and CriticalHeadKV: the base method's budgets, then the two stages."""
    state, tokens = make_state(case)
    attention = naive_window_attention(state)
    norms = naive_value_norms(state.values, o_proj_weight(state))
    for layer in range(3):
        layered = LayerState(**{**state.__dict__, "layer_idx": layer, "num_layers": 3})
        method = bind_synthetic(exact(ckv.get_method(name)), layered, seed=case[0])
        assert method.scores is not None
        budgets = method.budgets(method.scores(layered).float(), layered, tokens)
        keep = method.keep_mask(layered, tokens)
        assert torch.equal(keep, naive_critical(attention, norms, budgets, layered))
