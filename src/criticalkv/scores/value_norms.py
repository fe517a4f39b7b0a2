"""Projected value norms ``||V_i W_O^h||`` (CriticalKV, Feng et al. 2025, arXiv 2502.03805, Eq. 7)."""

from __future__ import annotations

import logging

import torch

#: precisions the projection can be computed in; ``"auto"`` is resolved by :func:`norm_dtype`
from criticalkv.defaults import NORM_PRECISIONS as NORM_PRECISIONS
from criticalkv.hardware import native_cpu_bf16

logger = logging.getLogger(__name__)

_CPU_CHUNK_BYTES = 1 << 20  # the (…, chunk, G*D) temporary stays in the L2 cache
_DEVICE_CHUNK_BYTES = 1 << 26  # on accelerators fewer, larger launches are faster


def norm_dtype(precision: str, values: torch.Tensor) -> torch.dtype:
    """The dtype the projection runs in.

    ``"exact"``: the values' own dtype (float32 for a float32 model). ``"auto"``: half-precision
    values keep their dtype (as the released code computes in the model's dtype); float32 values
    are projected in bfloat16 where the hardware multiplies bfloat16 natively (CUDA, CPUs with
    AVX512-BF16 or AMX), with float32 accumulation, else in float32. The norm's relative error in
    bfloat16 is about 2^-8; it only reorders near-ties (see docs/results/performance.md).
    """
    if precision not in NORM_PRECISIONS:
        raise ValueError(f"norm precision must be one of {', '.join(NORM_PRECISIONS)}, not {precision!r}")
    if precision == "exact":
        return values.dtype
    if precision != "auto":
        dtype: torch.dtype = getattr(torch, precision)
        return dtype
    if values.dtype != torch.float32:
        return values.dtype
    native = values.device.type == "cuda" or (values.device.type == "cpu" and native_cpu_bf16())
    return torch.bfloat16 if native else torch.float32


def norms_memo_key(p: int, dtype: torch.dtype) -> tuple[str, int, torch.dtype]:
    """The :attr:`~criticalkv.state.LayerState.memo` key of the ``p``-norms projected in ``dtype``.

    The selections look their norms up there; decode-time compression fills it with norms it
    computed once per entry, when the entry was appended.
    """
    return ("value_norms", p, dtype)


def _projection_shape(values: torch.Tensor, o_proj_weight: torch.Tensor) -> tuple[int, int]:
    """``(D, G)``: the hidden size and the GQA group size of ``o_proj_weight`` (D, H_q * d) for
    ``values`` (B, H_kv, T, d); a ``ValueError`` if they do not fit together."""
    h_kv, d = values.shape[1], values.shape[3]
    h_q = o_proj_weight.shape[1] // d
    if h_q * d != o_proj_weight.shape[1] or h_q % h_kv:
        raise ValueError(
            f"o_proj weight of shape {tuple(o_proj_weight.shape)} does not match values with "
            f"{h_kv} KV heads of size {d}"
        )
    return int(o_proj_weight.shape[0]), h_q // h_kv


@torch.no_grad()
def projected_value_norms(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    *,
    p: int = 1,
    precision: str = "exact",
    max_chunk_bytes: int | None = None,
) -> torch.Tensor:
    """Norm of each value row projected through its heads' slice of ``W_O``, GQA group mean.

    ``n_i^h = ||V_i @ W_O^h||_p`` with ``W_O^h = o_proj.weight[:, h*d:(h+1)*d].T``; the result
    is averaged over the ``G`` query heads that share each KV head, as the released code does.
    One matmul per sequence chunk covers every head: (B, H_kv, c, d) @ (H_kv, d, G*D).

    Parameters
    ----------
    values : (B, H_kv, T, d)
    o_proj_weight : (D, H_q * d), the output projection's weight.
    p : 1 (the paper) or 2.
    precision : see :func:`norm_dtype` (``"exact"`` by default here; the selection uses ``"auto"``).
    max_chunk_bytes : bound on the (B, H_kv, c, G*D) temporary (default: cache-sized on CPU).

    Returns
    -------
    (B, H_kv, T) float32, computed without autograd: a selection criterion is never
    differentiated, and a graph through ``o_proj``'s weight would hold every projected chunk.
    """
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, not {p}")
    b, h_kv, t, d = values.shape
    hidden, g = _projection_shape(values, o_proj_weight)
    dtype = norm_dtype(precision, values)
    # (D, H_q*d) -> (H_kv, d, G*D): column block j of head group k is W_O^{k*G + j}
    w_o = o_proj_weight.to(dtype).view(hidden, h_kv, g, d).permute(1, 3, 2, 0).reshape(h_kv, d, g * hidden)
    w_o = w_o.contiguous()
    v = values.to(dtype)
    if max_chunk_bytes is None:
        max_chunk_bytes = _CPU_CHUNK_BYTES if values.device.type == "cpu" else _DEVICE_CHUNK_BYTES
    per_token = b * h_kv * g * hidden * torch.empty((), dtype=dtype).element_size()
    chunk = max(1, max_chunk_bytes // max(per_token, 1))
    out = torch.empty(b, h_kv, t, dtype=torch.float32, device=values.device)
    for start in range(0, t, chunk):
        projected = torch.matmul(v[:, :, start : start + chunk], w_o)  # (B, H_kv, c, G*D)
        if p == 1:
            norms = projected.abs_().sum(-1, dtype=torch.float32) / g
        else:
            c = projected.shape[2]
            norms = projected.view(b, h_kv, c, g, hidden).float().norm(dim=-1).mean(-1)
        out[:, :, start : start + chunk] = norms
    return out


@torch.no_grad()
def gram_value_norms(values: torch.Tensor, o_proj_weight: torch.Tensor, *, precision: str = "exact") -> torch.Tensor:
    """``||V_i W_O^h||_2`` as ``sqrt(V_i^T (W_O^h W_O^h^T) V_i)``, GQA group mean: the same L2 norm as
    :func:`projected_value_norms` with ``p=2``, through a d x d Gram matrix per query head instead of
    the d x D projection (``d / D`` of its multiply-adds: 1/9 on SmolLM2-135M, 1/32 on Llama-3-8B).

    ``values`` (B, H_kv, T, d), ``o_proj_weight`` (D, H_q * d); returns (B, H_kv, T) float32.
    """
    b, h_kv, t, d = values.shape
    hidden, g = _projection_shape(values, o_proj_weight)
    dtype = norm_dtype(precision, values)
    blocks = o_proj_weight.float().view(hidden, h_kv, g, d).permute(1, 2, 3, 0)  # (H_kv, G, d, D) = W_O^h
    gram = (blocks @ blocks.transpose(-1, -2)).to(dtype)  # (H_kv, G, d, d), built in float32
    v = values.to(dtype)
    out = torch.zeros(b, h_kv, t, dtype=torch.float32, device=values.device)
    for j in range(g):
        quadratic = (torch.matmul(v, gram[None, :, j]).float() * v.float()).sum(-1)  # (B, H_kv, T)
        out += quadratic.clamp_min_(0.0).sqrt_()
    return out / g


@torch.no_grad()
def plain_value_norms(values: torch.Tensor, *, p: int = 1) -> torch.Tensor:
    """``||V_i||_p`` per KV head, without the output projection: the ablation of CriticalKV's
    ``W_O`` (the bound of Feng et al. 2025, Eq. 7, with ``W_O`` taken as the identity).

    ``values`` (B, H_kv, T, d); returns (B, H_kv, T) float32.
    """
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, not {p}")
    return values.float().norm(p=p, dim=-1)
