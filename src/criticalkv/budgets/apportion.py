"""Turning real-valued budget shares into integer per-head budgets with an exact total.

Layer-wise (PyramidKV) and head-wise (HeadKV) allocations produce real numbers. The released
codes round them one by one (``round`` or integer division), so the kept total drifts from the
budget the user asked for, and a share larger than the prompt is silently cut. Here the shares
are first fitted under a per-entry cap (:func:`capped_shares`), then rounded by the largest
remainder method (:func:`largest_remainder`), so each row keeps exactly its total.
"""

from __future__ import annotations

import torch


def capped_shares(values: torch.Tensor, caps: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """Rescale non-negative ``values`` to sum to ``totals`` per row with no entry above ``caps``.

    Entries that would exceed the cap are set to it; the overflow goes to the other entries in
    proportion to their values (equally, if none of them has a positive value). Where no entry
    binds, the values come back unchanged (up to rounding errors).

    Parameters
    ----------
    values : (B, N) float64, >= 0.
    caps : (B,) float64, the most one entry may hold.
    totals : (B,) float64, with ``0 <= totals <= N * caps``.

    Returns
    -------
    (B, N) float64 in ``[0, caps]``, each row summing to its total.
    """
    n = values.shape[-1]
    cap = caps[:, None].to(values.dtype)
    fixed = torch.zeros_like(values, dtype=torch.bool)
    out = values
    for _ in range(n + 1):  # each round fixes at least one more entry at its cap
        weights = values.masked_fill(fixed, 0.0)
        weightless = (weights.sum(-1, keepdim=True) <= 0) & ~fixed
        weights = torch.where(weightless, torch.ones_like(weights), weights)
        room = totals[:, None] - fixed.sum(-1, keepdim=True) * cap
        scale = room / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(values.dtype).tiny)
        out = torch.where(fixed, cap, weights * scale)
        over = (out > cap) & ~fixed
        if not bool(over.any()):
            break
        fixed |= over
    return out.clamp(min=0.0).minimum(cap)


def largest_remainder(values: torch.Tensor, totals: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Integer parts of ``values`` plus one for the largest fractional parts, to hit ``totals``.

    Each entry becomes the floor or the ceiling of its value (Hamilton's apportionment); ties in
    the fractional parts go to the lower index, so a non-increasing row stays non-increasing.

    Parameters
    ----------
    values : (B, N) float64 in ``[0, caps]``, rows summing to ``totals``.
    totals : (B,) int64.
    caps : (B,) int64, never exceeded.

    Returns
    -------
    (B, N) int64, rows summing to ``totals``.
    """
    cap = caps[:, None].long()
    floors = torch.minimum(torch.floor(values).long(), cap)
    need = totals.long() - floors.sum(-1)
    frac = (values - floors).masked_fill(floors >= cap, -1.0)
    order = torch.argsort(frac, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(values.shape[-1], device=values.device).expand_as(order))
    out = floors + (rank < need[:, None]).long()
    if not torch.equal(out.sum(-1), totals.long()) or bool((out > cap).any()):
        raise RuntimeError(f"could not apportion {totals.tolist()} entries over {values.shape[-1]} heads exactly")
    return out
