"""Loop-based references of CriticalKV's parts, read directly off the paper's Algorithm 2 (arXiv 2502.03805).

Everything here is written the slow way (Python loops over rows, heads and positions, float64)
so that it shares no code with the library: window attention, pooling, projected value norms,
AdaKV's allocation, the two-stage selection and the PyramidKV and HeadKV budgets. They always run
on the CPU: inputs on another device are copied here first.
"""

from __future__ import annotations

import math

import torch

from criticalkv.state import LayerState
from tests.helpers.random_state import to_device

ALPHA, EPS, KERNEL, ALPHA_FLOOR = 0.5, 1e-4, 5, 0.2


# --- naive building blocks -----------------------------------------------------------------------


def naive_window_attention(state: LayerState, kernel: int = KERNEL) -> torch.Tensor:
    """(B, H_kv, T) float64: softmax per window query, window mean, avg-pool, group mean."""
    state = to_device(state, "cpu")
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
    values, weight = values.cpu(), weight.cpu()
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
    scores, state, budget = scores.cpu(), to_device(state, "cpu"), budget.cpu()
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
    attention, norms, budgets, state = attention.cpu(), norms.cpu(), budgets.cpu(), to_device(state, "cpu")
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
