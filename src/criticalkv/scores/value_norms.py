"""Projected value norms ``||V_i W_O^h||`` (CriticalKV, Feng et al. 2025, arXiv 2502.03805, Eq. 7)."""

from __future__ import annotations

import torch


def projected_value_norms(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    *,
    p: int = 1,
    max_chunk_bytes: int = 1 << 25,
) -> torch.Tensor:
    """Norm of each value row projected through its heads' slice of ``W_O``, GQA group mean.

    ``n_i^h = ||V_i @ W_O^h||_p`` with ``W_O^h = o_proj.weight[:, h*d:(h+1)*d].T``; the result
    is averaged over the ``G`` query heads that share each KV head, as the released code does.

    Parameters
    ----------
    values : (B, H_kv, T, d)
    o_proj_weight : (D, H_q * d), the output projection's weight.
    p : 1 (the paper) or 2.
    max_chunk_bytes : bound on the (…, T_chunk, D) temporary; the sequence is processed in chunks.

    Returns
    -------
    (B, H_kv, T) float32.
    """
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, not {p}")
    b, h_kv, t, d = values.shape
    hidden = o_proj_weight.shape[0]
    h_q = o_proj_weight.shape[1] // d
    if h_q * d != o_proj_weight.shape[1] or h_q % h_kv:
        raise ValueError(
            f"o_proj weight of shape {tuple(o_proj_weight.shape)} does not match values with "
            f"{h_kv} KV heads of size {d}"
        )
    g = h_q // h_kv
    # (D, H_q*d) -> (H_kv, G, d, D)
    w_o = o_proj_weight.to(values.dtype).view(hidden, h_kv, g, d).permute(1, 2, 3, 0)
    per_token = b * h_q * hidden * values.element_size()
    chunk = max(1, max_chunk_bytes // max(per_token, 1))
    out = torch.empty(b, h_kv, t, dtype=torch.float32, device=values.device)
    for start in range(0, t, chunk):
        v = values[:, :, None, start : start + chunk, :]  # (B, H_kv, 1, c, d)
        projected = torch.matmul(v, w_o[None])  # (B, H_kv, G, c, D)
        norms = projected.abs().sum(-1, dtype=torch.float32) if p == 1 else projected.float().norm(dim=-1)
        out[:, :, start : start + chunk] = norms.mean(dim=2)
    return out
