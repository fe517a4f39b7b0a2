"""Fidelity to the full cache on the gold answer: NLL, top-1 agreement and KL under teacher forcing.

The log-probabilities come from :func:`criticalkv.runtime.teacher_forced_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fidelity:
    """Per-sample fidelity numbers (``kl`` and ``top1`` relative to the full cache)."""

    nll: float
    kl: float
    top1: float


def fidelity(logprobs: torch.Tensor, reference: torch.Tensor, gold: list[int]) -> Fidelity:
    """Mean per-token NLL of ``gold``; KL(full || compressed) and top-1 agreement, averaged over positions."""
    target = torch.tensor(gold, dtype=torch.long, device=logprobs.device)
    nll = float(-logprobs.gather(1, target[:, None]).mean())
    p_ref = reference.exp()
    kl = float((p_ref * (reference - logprobs)).sum(-1).clamp(min=0).mean())
    top1 = float((reference.argmax(-1) == logprobs.argmax(-1)).float().mean())
    return Fidelity(nll, kl, top1)
