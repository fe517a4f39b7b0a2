"""HeadKV's head-prior budgets (Fu et al. 2024, "Not All Heads Matter", arXiv 2410.19258)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from criticalkv.budgets.apportion import capped_shares, largest_remainder
from criticalkv.budgets.base import HeadScoredAllocator
from criticalkv.state import LayerState

ScoreMatrix = tuple[tuple[float, ...], ...]

UNBOUND = (
    "head-prior budgets (HeadKV) need the model's head importance scores, and none are bound; "
    "build the cache with CompressedCache.for_model(model, method, budget) (it finds the scores shipped "
    "with criticalkv or cached for the model), pass head_scores='scores.json', or compute them with "
    "`criticalkv head-scores --model MODEL --out scores.json`"
)


def score_matrix(scores: torch.Tensor | Sequence[Sequence[float]]) -> ScoreMatrix:
    """Check a (layers, KV heads) importance matrix and return it as nested tuples.

    Raises
    ------
    ValueError
        If it is not a non-empty rectangular 2-D array of finite, non-negative numbers with a
        positive sum.
    """
    try:
        tensor = torch.as_tensor(scores, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"head scores must be a (layers, KV heads) array of numbers: {err}") from err
    if tensor.dim() != 2 or tensor.numel() == 0:
        raise ValueError(
            f"head scores must be a non-empty (layers, KV heads) array, not of shape {tuple(tensor.shape)}"
        )
    if not bool(torch.isfinite(tensor).all()):
        bad = torch.nonzero(~torch.isfinite(tensor))[0].tolist()
        raise ValueError(f"head scores must be finite; layer {bad[0]}, KV head {bad[1]} is {tensor[bad[0], bad[1]]}")
    if bool((tensor < 0).any()):
        raise ValueError("head scores must be non-negative importances")
    if float(tensor.sum()) <= 0.0:
        raise ValueError(
            "head scores are all zero; no head can be preferred (recompute them on samples the model solves)"
        )
    return tuple(tuple(float(v) for v in row) for row in tensor.tolist())


@dataclass(frozen=True)
class HeadPrior(HeadScoredAllocator):
    """Per-(layer, KV head) budgets from offline head importance scores (HeadKV).

    With scores ``s_{l,h}`` normalised over all ``L * H_kv`` heads of the model, HeadKV's
    Eq. 4 gives head ``(l, h)`` the budget ``round(s_{l,h} * pool + b' - b'/beta)`` with the
    shared pool ``pool = (b'/beta) * L * H_kv``. As in the released HeadKV code the formula
    applies to the entries outside the observation window, ``b' = b - w``, and every head keeps
    its window on top, so no head falls below the window and the model keeps ``L * H_kv * b``
    entries per row in total.

    Two details make the totals exact where the released code drifts: a head whose share
    exceeds what the row holds outside the window (``n - w``) is capped there and its overflow
    goes to the other heads of the model in proportion to their shares; and the shares are
    rounded by the largest remainder method over all heads of the model (each head gets the
    floor or the ceiling of its share), not one by one. A layer keeps the sum of its heads'
    budgets, which varies across layers.

    Parameters
    ----------
    scores : (layers, KV heads) importances, e.g. from :mod:`criticalkv.headscores`; ``None``
        leaves the allocator unbound (:func:`criticalkv.methods.bind` binds a model's scores
        before a cache exists).
    beta : a finite number >= 1 (HeadKV's default 1.5). ``1`` shares the whole budget by the
        scores (a head with score 0 keeps only its window); larger values give every head more
        of a uniform base ``b' - b'/beta`` and approach uniform budgets.
    """

    scores: ScoreMatrix | None = None
    beta: float = 1.5

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)):
            raise TypeError(f"beta must be a number, not {self.beta!r}")
        if not math.isfinite(self.beta) or self.beta < 1.0:
            raise ValueError(
                f"beta must be a finite number >= 1, not {self.beta}: the base b - b/beta would be negative "
                "below 1; HeadKV's default is 1.5 (1: budgets by the scores alone, larger: closer to uniform)"
            )
        if self.scores is not None:
            object.__setattr__(self, "scores", score_matrix(self.scores))

    @property
    def bound(self) -> bool:
        """Whether head scores are bound."""
        return self.scores is not None

    def with_head_scores(self, scores: torch.Tensor | Sequence[Sequence[float]]) -> HeadPrior:
        """The same allocator bound to ``scores`` (layers, KV heads)."""
        return replace(self, scores=score_matrix(scores))

    def model_budgets(
        self, budget: torch.Tensor, lengths: torch.Tensor, window: int, num_layers: int, num_kv_heads: int
    ) -> torch.Tensor:
        """(B, L, H_kv) int64 entries per head of every layer, window included.

        ``budget`` and ``lengths`` are (B,): entries per head on average and real tokens per row.
        """
        if self.scores is None:
            raise ValueError(UNBOUND)
        prior = torch.tensor(self.scores, dtype=torch.float64, device=budget.device)
        if tuple(prior.shape) != (num_layers, num_kv_heads):
            raise ValueError(
                f"the head scores cover {prior.shape[0]} layers x {prior.shape[1]} KV heads, but the model has "
                f"{num_layers} layers x {num_kv_heads} KV heads; use scores computed for this model "
                "(`criticalkv head-scores --model MODEL --out scores.json`)"
            )
        heads = num_layers * num_kv_heads
        prior = (prior / prior.sum()).reshape(1, heads)
        selectable = (budget.long() - window).double()[:, None]  # (B, 1)
        pool = selectable / self.beta * heads
        shares = prior * pool + (selectable - selectable / self.beta)
        totals = heads * (budget.long() - window)
        caps = lengths.long() - window
        shares = capped_shares(shares, caps.double(), totals.double())
        return window + largest_remainder(shares, totals, caps).view(-1, num_layers, num_kv_heads)

    def __call__(self, scores: torch.Tensor, state: LayerState, budget: torch.Tensor) -> torch.Tensor:
        per_head = self.model_budgets(budget, state.lengths, state.window, state.num_layers, state.num_kv_heads)
        return per_head[:, state.layer_idx].clone()
