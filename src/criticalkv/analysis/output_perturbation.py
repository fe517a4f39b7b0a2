"""Per-head attention-output perturbation under eviction (CriticalKV, Feng et al. 2025, arXiv 2502.03805).

Notation of ``docs/perturbation.md``: for one layer, query head ``h`` (KV head ``h // G``), a query
with attention ``A`` over the ``T`` prompt keys and the projected values ``P_i^h = V_i W_O^h``,
the head's contribution to the residual stream is ``o = sum_i A_i P_i^h``. A keep
mask ``N`` of the KV head, with the kept weights renormalised by ``sigma = sum_i N_i A_i``, gives
``o_hat = sum_i N_i A_i P_i^h / sigma``; the perturbation is ``L = ||o - o_hat||_1``
(docs/perturbation.md, "The perturbation bound").

Everything here is vectorised over batch rows, query heads, queries and keep masks ("configs":
one mask per method and budget). ``V W_O^h`` is computed once per layer, in sequence chunks (the
``(T, D)`` projected values never exist in full), and its norms are shared by every config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from criticalkv.analysis.bound import kept_mass, perturbation_bound
from criticalkv.scores.value_norms import projected_value_norms

logger = logging.getLogger(__name__)

#: default bound on the large temporaries (projected values and difference weights) of one chunk
DEFAULT_CHUNK_BYTES = 1 << 25


def split_o_proj(o_proj_weight: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The output projection as per-head slices ``W_O^h``, grouped by KV head.

    Parameters
    ----------
    o_proj_weight : (D, H_q * d), ``o_proj.weight``.
    num_kv_heads : H_kv.
    head_dim : d.

    Returns
    -------
    (H_kv, G, d, D) float32, where ``[k, j]`` is ``W_O^h`` of query head ``h = k * G + j``:
    ``o_proj.weight[:, h*d:(h+1)*d].T``.
    """
    if o_proj_weight.dim() != 2:
        raise ValueError(f"o_proj weight must be 2-D (D, H_q * d), not of shape {tuple(o_proj_weight.shape)}")
    hidden, width = o_proj_weight.shape
    h_q = width // head_dim
    if h_q * head_dim != width or h_q % num_kv_heads:
        raise ValueError(
            f"o_proj weight of shape {tuple(o_proj_weight.shape)} does not match {num_kv_heads} KV heads "
            f"of size {head_dim}: its second dimension must be a multiple of {num_kv_heads * head_dim}"
        )
    g = h_q // num_kv_heads
    return o_proj_weight.detach().float().view(hidden, num_kv_heads, g, head_dim).permute(1, 2, 3, 0)


def attention_weights(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    query_positions: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over the prompt keys, in float32.

    Parameters
    ----------
    queries : (B, H_q, Q, d), after RoPE; query head ``h`` reads KV head ``h // G``.
    keys : (B, H_kv, T, d), after RoPE.
    scaling : the softmax scale (``module.scaling``).
    query_positions : (Q,) int, the column of each query: it sees the keys at columns ``<=`` its
        own (causal). A position ``>= T`` (a decode query) sees every prompt key.
    valid : (B, T) bool, ``False`` on padding (masked), or ``None``.

    Returns
    -------
    (B, H_q, Q, T) float32; each row sums to 1 over the keys it may see.
    """
    b, h_q, q, d = queries.shape
    kb, h_kv, t, kd = keys.shape
    if kb != b or kd != d or h_q % h_kv:
        raise ValueError(
            f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} do not match: need the same batch "
            "and head size, and a number of query heads that is a multiple of the KV heads"
        )
    if query_positions.shape != (q,):
        raise ValueError(f"query_positions must have shape ({q},), not {tuple(query_positions.shape)}")
    g = h_q // h_kv
    logits = torch.matmul(queries.float().reshape(b, h_kv, g * q, d), keys.float().transpose(-1, -2))
    logits = (logits * scaling).view(b, h_q, q, t)
    cols = torch.arange(t, device=keys.device)
    allowed = (cols[None, :] <= query_positions.to(keys.device)[:, None])[None, None]  # (1, 1, Q, T)
    if valid is not None:
        allowed = allowed & valid.to(keys.device)[:, None, None, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.softmax(logits, dim=-1)


def head_outputs(weights: torch.Tensor, values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """Per-head outputs as the residual stream sees them, ``o^h = A V W_O^h``.

    Summed over heads (plus ``o_proj``'s bias, if any) this is the attention module's output.

    Parameters
    ----------
    weights : (B, H_q, Q, T) attention weights (:func:`attention_weights`).
    values : (B, H_kv, T, d).
    o_proj_weight : (D, H_q * d).

    Returns
    -------
    (B, H_q, Q, D) float32.
    """
    b, h_q, q, t = weights.shape
    _, h_kv, _, d = values.shape
    w_o = split_o_proj(o_proj_weight, h_kv, d)
    g = h_q // h_kv
    mixed = torch.matmul(weights.reshape(b, h_kv, g * q, t), values.float()).view(b, h_kv, g, q, d)
    return torch.matmul(mixed, w_o[None]).view(b, h_q, q, -1)


@dataclass(frozen=True)
class LayerPerturbation:
    """What :func:`output_perturbation` measures for one layer, per keep mask.

    Attributes
    ----------
    l1 : (C, B, H_q, Q) float32, ``L = ||o - o_hat||_1``.
    sigma : (C, B, H_q, Q) float64, the kept attention mass.
    theta : (C, B, H_q, Q) float64, the bound ``C - (2 - 1/sigma) sum_kept A_i n_i``.
    norms : (B, H_q, T) float32, ``n_i^h = ||V_i W_O^h||_1`` per query head.
    """

    l1: torch.Tensor
    sigma: torch.Tensor
    theta: torch.Tensor
    norms: torch.Tensor


def _check_keep(weights: torch.Tensor, keep: torch.Tensor, values: torch.Tensor) -> None:
    b, h_q, _, t = weights.shape
    if values.dim() != 4 or values.shape[0] != b or values.shape[2] != t or h_q % values.shape[1]:
        raise ValueError(f"values {tuple(values.shape)} do not match attention weights {tuple(weights.shape)}")
    if keep.dim() != 4 or tuple(keep.shape[1:]) != (b, values.shape[1], t):
        raise ValueError(
            f"keep must be a (C, B, H_kv, T) = (C, {b}, {values.shape[1]}, {t}) bool mask, "
            f"not of shape {tuple(keep.shape)}"
        )


def head_value_norms(
    values: torch.Tensor, o_proj_weight: torch.Tensor, *, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> torch.Tensor:
    """``n_i^h = ||V_i W_O^h||_1`` for every query head (not the GQA group mean), in float32.

    The selection's :func:`~criticalkv.scores.value_norms.projected_value_norms` (exact
    precision), once per position ``j`` in the query-head groups: the query heads ``k * G + j``
    of all KV heads ``k`` form a "group" of one head each, so its group mean is each head's norm.

    Parameters
    ----------
    values : (B, H_kv, T, d).
    o_proj_weight : (D, H_q * d).
    max_chunk_bytes : bound on one chunk's projected values.

    Returns
    -------
    (B, H_q, T) float32.
    """
    if max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be positive, not {max_chunk_bytes}")
    b, h_kv, t, d = values.shape
    w_o = split_o_proj(o_proj_weight, h_kv, d)  # (H_kv, G, d, D); checks the shapes
    g, hidden = w_o.shape[1], w_o.shape[-1]
    v = values.float()
    # the o_proj columns of query heads k * G + j, for k = 0 .. H_kv - 1: (D, H_kv * d)
    columns = [w_o[:, j].permute(2, 0, 1).reshape(hidden, h_kv * d) for j in range(g)]
    norms = [projected_value_norms(v, c, precision="exact", max_chunk_bytes=max_chunk_bytes) for c in columns]
    return torch.stack(norms, dim=2).view(b, h_kv * g, t)


@torch.no_grad()
def output_perturbation(
    weights: torch.Tensor,
    keep: torch.Tensor,
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    *,
    norms: torch.Tensor | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> LayerPerturbation:
    """The L1 head-output perturbation of each keep mask, with its bound (docs/perturbation.md).

    ``o - o_hat = sum_i w_i P_i^h`` with ``w_i = A_i`` on evicted entries and
    ``w_i = -A_i (1 - sigma) / sigma`` on kept ones: no cancellation between ``o`` and ``o_hat``.
    Since ``P_i^h = V_i W_O^h``, the sum is taken in value space and projected once,
    ``(sum_i w_i V_i) W_O^h``, which costs ``d`` instead of ``D`` per entry; ``V W_O^h`` itself
    is only needed for the norms ``n_i^h`` of the bound (computed once per layer, in chunks,
    and shared by every keep mask).

    Parameters
    ----------
    weights : (B, H_q, Q, T) attention weights over the prompt keys (:func:`attention_weights`).
    keep : (C, B, H_kv, T) bool, one keep mask per config (method and budget); a mask must keep
        at least one entry each query sees.
    values : (B, H_kv, T, d).
    o_proj_weight : (D, H_q * d).
    norms : (B, H_q, T) :func:`head_value_norms`, if already computed for these values.
    max_chunk_bytes : bound on one chunk's difference weights (C, B, H_q, Q, T_chunk) and
        projected values; the sequence is processed in chunks.

    Returns
    -------
    :class:`LayerPerturbation`.
    """
    _check_keep(weights, keep, values)
    if max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be positive, not {max_chunk_bytes}")
    b, h_q, q, t = weights.shape
    c = keep.shape[0]
    _, h_kv, _, d = values.shape
    g = h_q // h_kv
    w_o = split_o_proj(o_proj_weight, h_kv, d)
    if norms is None:
        norms = head_value_norms(values, o_proj_weight, max_chunk_bytes=max_chunk_bytes)
    sigma, evicted = kept_mass(weights, keep)
    if bool((sigma <= 0).any()):
        raise ValueError("a keep mask keeps no entry that some query attends to; keep at least the window")
    # (C, B, H_q, Q) -> (B, H_kv, G, C, Q, 1): the weight factor on kept entries
    ratio = (-(evicted / sigma)).float().permute(1, 2, 0, 3).reshape(b, h_kv, g, c, q, 1)
    kept = keep.permute(1, 2, 0, 3)[:, :, None, :, None, :]  # (B, H_kv, 1, C, 1, T)
    attn = weights.float().view(b, h_kv, g, 1, q, t)
    chunk = max(1, max_chunk_bytes // (4 * b * h_q * c * q))
    mixed = torch.zeros(b, h_kv, g * c * q, d, dtype=torch.float32, device=weights.device)
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        coef = torch.where(kept[..., start:stop], ratio, 1.0)  # (B, H_kv, G, C, Q, c)
        diff = (attn[..., start:stop] * coef).reshape(b, h_kv, g * c * q, stop - start)
        mixed += torch.matmul(diff, values[:, :, start:stop, :].float())
    # (B, H_kv, G, C*Q, d) @ (H_kv, G, d, D) -> (B, H_kv, G, C*Q, D)
    delta = torch.matmul(mixed.view(b, h_kv, g, c * q, d), w_o[None])
    l1 = delta.abs().sum(-1).view(b, h_q, c, q).permute(2, 0, 1, 3)
    bound = perturbation_bound(weights, keep, norms, sigma=sigma, evicted=evicted)
    return LayerPerturbation(l1=l1, sigma=sigma, theta=bound.theta, norms=norms)
