"""PyramidKV's layer-wise budgets (Cai et al. 2024, arXiv 2406.02069)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from criticalkv.budgets.apportion import largest_remainder
from criticalkv.budgets.base import Allocator
from criticalkv.state import LayerState


@dataclass(frozen=True)
class Pyramid(Allocator):
    """Budgets that decrease linearly with depth, with the same total as uniform budgets.

    As in PyramidKV (Cai et al. 2024, Sec. 3; the KVCache-Factory code), the shares apply to
    the entries outside the observation window, ``b' = b - w``: the first layer gets
    ``b_max = 2 b' - b_min``, the last ``b_min = b' / beta``, the layers in between lie on the
    line, and every head of a layer gets its layer's share plus the window. If ``b_max`` would
    exceed what a row holds outside the window (``n - w``), it is lowered to ``n - w`` and
    ``b_min`` raised to ``2 b' - (n - w)``, keeping the mean. The shares are rounded by the
    largest remainder method, so the layers of a row keep exactly ``L * b`` entries per head
    in total and the budgets never increase with depth.

    Parameters
    ----------
    beta : how steep the pyramid is, a finite number >= 1 (PyramidKV's default 20); 1 gives
        uniform budgets, larger values a steeper pyramid.
    """

    beta: float = 20.0

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)):
            raise TypeError(f"beta must be a number, not {self.beta!r}")
        if not math.isfinite(self.beta) or self.beta < 1.0:
            raise ValueError(
                f"beta must be a finite number >= 1, not {self.beta}; 1 gives uniform budgets, "
                "PyramidKV's default is 20"
            )

    def layer_budgets(self, budget: torch.Tensor, lengths: torch.Tensor, window: int, num_layers: int) -> torch.Tensor:
        """(B, L) int64 entries per head of each layer, window included.

        ``budget`` and ``lengths`` are (B,): entries per head on average and real tokens per row.
        """
        selectable = (budget.long() - window).double()
        cap = (lengths.long() - window).double()
        low = selectable / self.beta
        high = 2.0 * selectable - low
        over = high > cap
        high = torch.where(over, cap, high)
        low = torch.where(over, 2.0 * selectable - cap, low)
        if num_layers == 1:
            shares = selectable[:, None]
        else:
            depth = torch.arange(num_layers, dtype=torch.float64, device=budget.device) / (num_layers - 1)
            shares = high[:, None] - (high - low)[:, None] * depth[None, :]
        shares = torch.minimum(shares.clamp(min=0.0), cap[:, None])
        totals = num_layers * (budget.long() - window)
        return window + largest_remainder(shares, totals, lengths.long() - window)

    def __call__(self, scores: torch.Tensor, state: LayerState, budget: torch.Tensor) -> torch.Tensor:
        per_layer = self.layer_budgets(budget, state.lengths, state.window, state.num_layers)
        return per_layer[:, state.layer_idx, None].expand(-1, state.num_kv_heads).clone()
