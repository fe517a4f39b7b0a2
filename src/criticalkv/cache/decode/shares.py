"""Per-layer decode budgets for methods whose budgets span layers (``layer-defensivekv``).

Their prompt selection gives each layer as many entries as its scores earn over the whole model
(:class:`~criticalkv.budgets.LayerJoint`). Decode-time compression re-selects one layer at a time,
with only that layer's last ``window`` queries at hand, so it cannot rank all layers again at each
interval: that would need every layer's entries and queries at the step where any layer overflows,
and one layer's overflow would evict entries of layers that did not grow. Instead each layer's
share of the decode budget is frozen from the prompt's joint selection: the model's
``L * D`` entries per KV head (``D`` the decode budget) are split over the layers in proportion to
what each kept beyond its window, every layer keeping at least its window. Each layer is then
re-selected to its own share by the method's selection over that layer's heads, so memory stays
at most ``L * (D + interval + 1)`` entries per KV head, as for a per-layer method.
"""

from __future__ import annotations

import torch

from criticalkv.budgets.apportion import capped_shares, largest_remainder


def joint_shares(held: torch.Tensor, budget: int, window: int) -> torch.Tensor:
    """(L, B) int64 decode budgets per KV head on average, one per layer and batch row.

    ``held`` is (L, B): the entries per KV head on average each layer kept of the prompt. Each row's
    shares sum to exactly ``L * budget``; each is at least ``window`` and, when the prompt was
    selected at no more than ``budget`` per head (the cache clamps it), at least what the layer holds
    already (up to rounding), so no layer is re-selected before it has grown.
    """
    if held.dim() != 2:
        raise ValueError(f"held must be (layers, rows), got shape {tuple(held.shape)}")
    if budget < window:
        raise ValueError(f"the decode budget {budget} is below the window {window}")
    n_layers, rows = held.shape
    spare = n_layers * (budget - window)
    totals = torch.full((rows,), float(spare), dtype=torch.float64, device=held.device)
    earned = (held.double().T - window).clamp(min=0.0)  # (B, L) what each layer kept beyond its window
    fitted = capped_shares(earned, totals, totals)  # no layer capped below the whole spare budget
    extra = largest_remainder(fitted, totals.long(), totals.long())
    return (window + extra).T.contiguous()
