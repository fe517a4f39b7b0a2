"""The output-perturbation bound ``theta`` (Feng et al. 2025, arXiv 2502.03805).

With a keep mask ``N``, kept attention mass ``sigma = sum_i N_i A_i``, projected-value norms
``n_i = ||V_i W_O^h||_1`` and ``C = sum_i A_i n_i``, the L1 perturbation of a head's output obeys

    L <= theta = C - (2 - 1/sigma) * sum_i N_i A_i n_i.

It follows from the triangle inequality (``o - o_hat`` puts weight ``A_i`` on each evicted entry
and ``-A_i (1 - sigma) / sigma`` on each kept one), so it holds for every ``sigma`` in (0, 1];
the paper states it for ``sigma > 1/2``, where minimising ``theta`` means maximising the kept
``sum A_i n_i``. It is computed here in the equivalent, cancellation-free form

    theta = sum_evicted A_i n_i + ((1 - sigma) / sigma) * sum_kept A_i n_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _as_columns(keep: torch.Tensor) -> torch.Tensor:
    """(C, B, H_kv, T) bool -> (B, H_kv, T, C) float64, the right operand of a kept-sum matmul."""
    return keep.permute(1, 2, 3, 0).double()


def _kept_sums(rows: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of (B, H_q, Q, T) ``rows`` over the kept and the evicted entries: two (C, B, H_q, Q) float64."""
    b, h_q, q, t = rows.shape
    h_kv = keep.shape[2]
    flat = rows.double().reshape(b, h_kv, (h_q // h_kv) * q, t)
    columns = _as_columns(keep)
    kept = torch.matmul(flat, columns)  # (B, H_kv, G*Q, C)
    evicted = torch.matmul(flat, 1.0 - columns)
    c = keep.shape[0]

    def back(x: torch.Tensor) -> torch.Tensor:
        return x.view(b, h_q, q, c).permute(3, 0, 1, 2)

    return back(kept), back(evicted)


def kept_mass(weights: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept attention mass ``sigma = sum_i N_i A_i`` and the evicted mass, per config and query.

    Parameters
    ----------
    weights : (B, H_q, Q, T) attention weights; query head ``h`` reads KV head ``h // G``.
    keep : (C, B, H_kv, T) bool keep masks.

    Returns
    -------
    sigma, evicted : two (C, B, H_q, Q) float64 tensors (computed separately, so a small evicted
    mass keeps its precision).
    """
    if keep.dim() != 4 or weights.dim() != 4 or weights.shape[1] % keep.shape[2]:
        raise ValueError(
            f"weights must be (B, H_q, Q, T) and keep (C, B, H_kv, T) with H_q a multiple of H_kv; "
            f"got {tuple(weights.shape)} and {tuple(keep.shape)}"
        )
    return _kept_sums(weights, keep)


@dataclass(frozen=True)
class Bound:
    """Terms of the bound, each (C, B, H_q, Q) float64.

    Attributes
    ----------
    sigma : kept attention mass.
    total : ``C = sum_i A_i n_i``.
    kept : ``sum_i N_i A_i n_i``, what CriticalKV's second stage maximises.
    theta : the bound on ``||o - o_hat||_1``.
    """

    sigma: torch.Tensor
    total: torch.Tensor
    kept: torch.Tensor
    theta: torch.Tensor


def perturbation_bound(
    weights: torch.Tensor,
    keep: torch.Tensor,
    norms: torch.Tensor,
    *,
    sigma: torch.Tensor | None = None,
    evicted: torch.Tensor | None = None,
) -> Bound:
    """``theta = C - (2 - 1/sigma) sum_i N_i A_i n_i`` per config, batch row, query head and query.

    Parameters
    ----------
    weights : (B, H_q, Q, T) attention weights.
    keep : (C, B, H_kv, T) bool keep masks.
    norms : (B, H_q, T), ``n_i^h = ||V_i W_O^h||_1`` of each query head (not the GQA mean).
    sigma, evicted : :func:`kept_mass`'s output, if already computed.

    Returns
    -------
    :class:`Bound`.
    """
    if norms.shape != (weights.shape[0], weights.shape[1], weights.shape[3]):
        raise ValueError(f"norms must be (B, H_q, T) matching weights {tuple(weights.shape)}, not {tuple(norms.shape)}")
    if sigma is None or evicted is None:
        sigma, evicted = kept_mass(weights, keep)
    weighted = weights.double() * norms.double()[:, :, None, :]
    kept, lost = _kept_sums(weighted, keep)
    theta = lost + (evicted / sigma) * kept
    return Bound(sigma=sigma, total=kept + lost, kept=kept, theta=theta)
