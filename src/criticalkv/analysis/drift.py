"""Final-layer hidden-state drift of a compressed cache versus the full cache.

The paper's second perturbation claim (Feng et al. 2025, arXiv 2502.03805): a selection
that lowers the per-head output perturbation also lowers the perturbation of the last hidden
state, the one the language-model head reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HiddenDrift:
    """Per-token drift of compressed hidden states, each a (B, n) float64 tensor.

    Attributes
    ----------
    l1 : ``||h - h_hat||_1``.
    relative_l1 : ``||h - h_hat||_1 / ||h||_1``.
    cosine : cosine similarity of ``h`` and ``h_hat`` (1 means no drift in direction).
    """

    l1: torch.Tensor
    relative_l1: torch.Tensor
    cosine: torch.Tensor

    def means(self) -> dict[str, float]:
        """The three measures averaged over tokens and batch rows."""
        return {
            "hidden_l1": float(self.l1.mean()),
            "hidden_l1_relative": float(self.relative_l1.mean()),
            "hidden_cosine": float(self.cosine.mean()),
        }


def hidden_state_drift(full: torch.Tensor, compressed: torch.Tensor) -> HiddenDrift:
    """Drift of ``compressed`` (B, n, D) hidden states from the ``full``-cache ones, per token.

    Parameters
    ----------
    full : (B, n, D) final-layer hidden states decoded with the full cache.
    compressed : (B, n, D) the same tokens decoded with a compressed cache.

    Returns
    -------
    :class:`HiddenDrift`.
    """
    if full.shape != compressed.shape or full.dim() != 3:
        raise ValueError(
            f"hidden states must both be (B, n, D) of the same shape; got {tuple(full.shape)} and "
            f"{tuple(compressed.shape)}"
        )
    h, h_hat = full.double(), compressed.double()
    l1 = (h - h_hat).abs().sum(-1)
    relative = l1 / h.abs().sum(-1).clamp(min=torch.finfo(torch.float64).tiny)
    cosine = torch.nn.functional.cosine_similarity(h, h_hat, dim=-1)
    return HiddenDrift(l1=l1, relative_l1=relative, cosine=cosine)
