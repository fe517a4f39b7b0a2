"""Loop-based references of the TOVA, KeyDiff and Expected Attention scores, straight from their
definitions (one row, one head, one position at a time; float64), for the oracle tests."""

from __future__ import annotations

import math

import torch

from criticalkv.state import LayerState


def _real(state: LayerState, b: int) -> list[int]:
    return [int(i) for i in state.valid[b].nonzero()[:, 0]]


def tova_reference(state: LayerState, heads: str = "all") -> torch.Tensor:
    """Softmax of the last query over the row's keys, averaged over all (or the group's) heads."""
    b_n, h_kv, t, _ = state.keys.shape
    g = state.group_size
    out = torch.zeros(b_n, h_kv, t, dtype=torch.float64)
    for b in range(b_n):
        real = _real(state, b)
        per_head = []
        for h in range(h_kv * g):
            q = state.queries[b, h, -1].double()
            logits = torch.tensor(
                [float(q @ state.keys[b, h // g, j].double()) * state.scaling for j in real], dtype=torch.float64
            )
            per_head.append(torch.softmax(logits, dim=0))
        for kv in range(h_kv):
            chosen = per_head if heads == "all" else per_head[kv * g : (kv + 1) * g]
            out[b, kv, real] = torch.stack(chosen).mean(0)
    return out


def keydiff_reference(state: LayerState) -> torch.Tensor:
    """``-cos(k_j, mean_i k_i / ||k_i||)`` over the row's real keys."""
    b_n, h_kv, t, _ = state.keys.shape
    out = torch.zeros(b_n, h_kv, t, dtype=torch.float64)
    for b in range(b_n):
        real = _real(state, b)
        for h in range(h_kv):
            keys = [state.keys[b, h, j].double() for j in real]
            anchor = sum(k / max(float(k.norm()), 1e-12) for k in keys) / len(keys)
            for j, k in zip(real, keys, strict=True):
                denom = max(float(k.norm()) * float(anchor.norm()), 1e-8)
                out[b, h, j] = -float(k @ anchor) / denom
    return out


def rope_matrix(position: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """The (d, d) RoPE rotation at ``position``: pairs (i, i + d/2) rotated by ``position * f_i``."""
    half = inv_freq.shape[0]
    r = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    for i in range(half):
        angle = position * float(inv_freq[i])
        c, s = math.cos(angle), math.sin(angle)
        r[i, i], r[i, i + half], r[i + half, i], r[i + half, i + half] = c, -s, s, c
    return r


def expected_attention_reference(
    state: LayerState, *, future: int, sinks: int, covariance: bool, value_norm: bool, eps: float = 0.0
) -> torch.Tensor:
    """Expected Attention from its definition (default RoPE, ``rope_theta`` from the module's config)."""
    b_n, h_kv, t, d = state.keys.shape
    g = state.group_size
    theta = float(state.module.config.rope_parameters["rope_theta"])
    inv_freq = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    s = state.scaling
    out = torch.zeros(b_n, h_kv, t, dtype=torch.float64)
    for b in range(b_n):
        real = _real(state, b)
        length = len(real)
        future_rot = sum(rope_matrix(length + f, inv_freq) for f in range(future)) / future
        scores = torch.zeros(h_kv, g, t, dtype=torch.float64)
        for h in range(h_kv * g):
            pre = [rope_matrix(p, inv_freq).T @ state.queries[b, h, -t + j].double() for p, j in enumerate(real)]
            used = torch.stack(pre[sinks:])
            mean = used.mean(0)
            mu = future_rot @ mean
            cov = future_rot @ ((used - mean).T @ (used - mean) / used.shape[0]) @ future_rot.T
            keys = real[sinks:]
            logits = []
            for j in keys:
                k = state.keys[b, h // g, j].double()
                logits.append(s * float(mu @ k) + (s * s / 2 * float(k @ cov @ k) if covariance else 0.0))
            scores[h // g, h % g, keys] = torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0)
        head = scores.mean(1)
        if value_norm:
            head = (head + eps) * state.values[b].double().norm(dim=-1)
        for kv in range(h_kv):
            top = max(float(head[kv, j]) for j in real)
            for j in real[:sinks]:
                head[kv, j] = top
            out[b, kv, real] = head[kv, real]
    return out
