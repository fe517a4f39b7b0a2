"""DefensiveKV's selection: an adaptive CriticalKV stage 1, then attention x head-normalised value
norms (Feng et al. 2025, "Taming the Fragility of KV Cache Eviction in LLM Inference", arXiv 2510.13334)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.scores.window_attention import WindowAttention
from criticalkv.select.base import RankingSelector
from criticalkv.select.critical import Critical
from criticalkv.select.topk import topk_mask
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)

#: rank of stage-1 entries: above any score an attention-based scorer produces, ordered by attention
FORCED = torch.finfo(torch.float32).max / 4

_MEAN_ATTENTION = WindowAttention(pool="none")


@dataclass(frozen=True)
class AdaptiveCritical(RankingSelector):
    """CriticalKV's two stages with an adaptive stage 1, as in the released DefensiveKV code.

    Stage 1, per head: the entries in decreasing mean window attention (unpooled, mean over the
    window queries and the GQA group), until the head's kept attention mass reaches
    ``threshold``, at most ``b - w`` of them (``b`` the row's budget per head). Stage 2: the
    rest of the budget by ``score_i * n_{h,i} / sum_h' n_{h',i}``, where ``n`` is the L1 norm of
    the value projected through ``W_O`` (GQA group mean, as in CriticalKV) normalised across the
    KV heads of the same token. With one KV head that factor is 1 and stage 2 ranks by the score.

    The selection is a *ranking* (:meth:`rank`): stage-1 entries first, then stage 2's order.
    :class:`~criticalkv.methods.Method` allocates the per-head budgets on that ranking (the
    released code takes the layer's, or the model's, top entries of it across heads) and then
    each head keeps its window plus its ``b_h - w`` top-ranked entries (:meth:`__call__`), so a
    head keeps at most ``b_h - w`` stage-1 entries, the highest by attention, whatever the budgets.

    Window correction. The window (always kept) holds part of each head's attention mass, so
    stage 1 needs less outside it. The released code subtracts a "window bias" from the 0.9
    threshold, but computes it after the window columns have been sliced off: it measures the
    mass on the ``w`` tokens *before* the window, averaged over the batch, all heads and queries,
    and subtracts it from a threshold on the mass normalised over the non-window tokens. Here
    (``window_correction=True``) the window's own mass ``m_h`` is measured per row and KV head, and
    stage 1 keeps the fewest entries whose mass reaches ``threshold - m_h``, so the head's kept
    mass, window included, reaches ``threshold`` (the released code stops one entry short of the
    threshold; here the entry that reaches it is kept). ``window_correction=False`` asks
    ``threshold`` of the non-window mass alone (the released formula without the bias).

    Parameters
    ----------
    threshold : attention mass stage 1 keeps, in [0, 1] (0.9 in the released code).
    window_correction : count the window's mass toward the threshold (see above).
    p : norm of the projected values, 1 (the released code) or 2.
    precision : dtype of the projection ``V W_O``, as for :class:`~criticalkv.select.Critical`
        (``"auto"``, ``"exact"``, ``"float32"``, ``"bfloat16"``, ``"float16"``); the norms are
        shared with the Critical methods compressing the same prefill.
    """

    top_ranked: ClassVar[bool] = True

    threshold: float = 0.9
    window_correction: bool = True
    p: int = 1
    precision: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be an attention mass in [0, 1], not {self.threshold!r}")
        if self.p not in (1, 2):
            raise ValueError(f"p must be 1 or 2, not {self.p}")
        Critical(p=self.p, precision=self.precision)  # validates the precision

    def stage1(self, state: LayerState, budget: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, T) bool: the stage-1 entries of each head, given the (B,) budget per head."""
        attention = _MEAN_ATTENTION(state)  # rows sum to 1 over all real keys
        eligible = state.eligible
        window_mass = (attention * state.window_mask).sum(-1).double()  # (B, H_kv)
        # the mass stage 1 must add to the window's; without the correction, a share of the non-window mass
        target = self.threshold - window_mass if self.window_correction else self.threshold * (1.0 - window_mass)
        ranked = attention.masked_fill(~eligible, 0.0).double().sort(dim=-1, descending=True).values
        reached = ranked.cumsum(-1)  # reached[k - 1]: mass of the top k entries
        count = (reached < target[..., None]).sum(-1) + 1  # the fewest entries whose mass reaches the target
        count = torch.where(target > 0, count, torch.zeros_like(count))
        cap = (budget.long() - state.window).clamp_min(0)[:, None]
        count = torch.minimum(torch.minimum(count, eligible.sum(-1)), cap)
        return topk_mask(attention, count, eligible)

    def norm_shares(self, state: LayerState) -> torch.Tensor:
        """(B, H_kv, T) projected value norms, each token's normalised to sum 1 over the KV heads."""
        norms = Critical(p=self.p, precision=self.precision).norms(state)
        total = norms.sum(dim=1, keepdim=True)
        return torch.where(total > 0, norms / total.clamp_min(torch.finfo(norms.dtype).tiny), torch.zeros_like(norms))

    def rank(self, scores: torch.Tensor, state: LayerState, budget: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, T) the order of preference: stage 1 (``>= FORCED``), then score x norm share.

        ``scores`` is (B, H_kv, T) with ``-inf`` where an entry cannot be chosen; ``budget`` the
        (B,) entries per head on average, window included. Ineligible entries rank ``-inf``.
        """
        eligible = state.eligible
        weighted = scores.float().masked_fill(~eligible, 0.0) * self.norm_shares(state)
        forced = self.stage1(state, budget)
        ranked = torch.where(forced, FORCED * (1.0 + _MEAN_ATTENTION(state)), weighted)
        return ranked.masked_fill(~eligible, float("-inf"))

    def __call__(self, scores: torch.Tensor, budgets: torch.Tensor, state: LayerState) -> torch.Tensor:
        """Keep the window and the ``budgets - w`` top entries of the ranking ``scores`` per head."""
        chosen = topk_mask(scores, budgets - state.window, state.eligible)
        return chosen | state.window_mask
