"""CriticalKV's two-stage selection (Feng et al. 2025, arXiv 2502.03805, Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.needs import Needs
from criticalkv.scores.value_norms import (
    NORM_PRECISIONS,
    gram_value_norms,
    norm_dtype,
    norms_memo_key,
    plain_value_norms,
    projected_value_norms,
)
from criticalkv.select.base import Selector
from criticalkv.select.topk import topk_mask
from criticalkv.state import LayerState


@dataclass(frozen=True)
class Critical(Selector):
    """Stage 1 keeps ``floor(alpha * b_h)`` entries by attention (window included), which
    keeps the kept attention mass above 1/2; stage 2 fills the rest of the head's budget by
    ``(A_i + eps) * ||V_i W_O||``, the entry's share of the output-perturbation bound.

    Parameters
    ----------
    alpha : share of the budget chosen by attention alone (0.5 in the paper).
    eps : added to the attention before weighting by the norm (1e-4 in the released code).
    p : norm of the projected values, 1 (paper) or 2.
    precision : dtype of the projection ``V W_O`` (see :func:`~criticalkv.scores.value_norms.norm_dtype`):
        ``"auto"`` (bfloat16 for float32 values where the hardware has native bfloat16, as the
        released code computes in the model's half precision on GPU), ``"exact"`` (the values'
        dtype), or an explicit ``"float32"`` / ``"bfloat16"`` / ``"float16"``.
    gram : with ``p=2``, compute ``||V_i W_O^h||_2`` exactly as ``sqrt(V_i^T (W_O^h W_O^h^T) V_i)``
        (:func:`~criticalkv.scores.value_norms.gram_value_norms`), ``d / D`` of the projection's work.
    projected : weight by ``||V_i W_O^h||_p`` (the paper, default); ``False`` weights by the plain
        ``||V_i||_p`` instead (:func:`~criticalkv.scores.value_norms.plain_value_norms`), the
        ablation of the output projection.
    """

    alpha: float = 0.5
    eps: float = 1e-4
    p: int = 1
    needs: ClassVar[Needs] = Needs(value_norms=True)

    precision: str = "auto"
    gram: bool = False
    projected: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], not {self.alpha}")
        if self.eps < 0:
            raise ValueError(f"eps must be >= 0, not {self.eps}")
        if self.p not in (1, 2):
            raise ValueError(f"p must be 1 or 2, not {self.p}")
        if self.precision not in NORM_PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(NORM_PRECISIONS)}, not {self.precision!r}")
        if self.gram and self.p != 2:
            raise ValueError("gram=True computes the L2 norm: pass p=2 with it")
        if not isinstance(self.projected, bool):
            raise TypeError(f"projected must be True or False, not {self.projected!r}")
        if self.gram and not self.projected:
            raise ValueError("gram=True computes the projected norm: it cannot be combined with projected=False")

    def norms(self, state: LayerState) -> torch.Tensor:
        """(B, H_kv, T) projected value norms, GQA group mean (plain ``||V_i||_p`` if not ``projected``)."""
        if not self.projected:
            return state.remember(("value_norms_plain", self.p), lambda: plain_value_norms(state.values, p=self.p))
        weight: torch.Tensor = state.module.o_proj.weight  # type: ignore[union-attr,assignment]
        dtype = norm_dtype(self.precision, state.values)
        precision = str(dtype).removeprefix("torch.")
        if self.gram:
            return state.remember(
                ("value_norms_gram", dtype), lambda: gram_value_norms(state.values, weight, precision=precision)
            )
        return state.remember(
            norms_memo_key(self.p, dtype),
            lambda: projected_value_norms(state.values, weight, p=self.p, precision=precision),
        )

    def __call__(self, scores: torch.Tensor, budgets: torch.Tensor, state: LayerState) -> torch.Tensor:
        w = state.window
        eligible = state.eligible
        k1 = torch.clamp(torch.floor(self.alpha * budgets.double()).long() - w, min=0)
        stage1 = topk_mask(scores, k1, eligible)
        weighted = (scores + self.eps) * self.norms(state)
        k2 = budgets - w - stage1.sum(-1)
        stage2 = topk_mask(weighted, k2, eligible & ~stage1)
        return stage1 | stage2 | state.window_mask
