"""Fidelity to the full cache on the gold answer: NLL, top-1 agreement and KL under teacher forcing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.compat import cache_argument
from criticalkv.prompts import positions


@torch.no_grad()
def answer_logprobs(
    model: Any,
    cache: CompressedCache,
    prompt_mask: torch.Tensor,
    suffix: list[int],
    answer_len: int,
    first_logits: torch.Tensor | None,
) -> torch.Tensor:
    """(B, answer_len, V) float32 log-probabilities of each gold answer position, teacher-forced.

    ``cache`` holds the prompt (it is extended: pass a fork). ``suffix`` is what follows the
    cached tokens: the question (question-agnostic mode) then the gold answer. With
    ``first_logits`` (B, V) (question-aware mode: the prefill's last logits) the suffix is the
    answer alone and its first token is predicted by those logits. Every row gets the same suffix.
    """
    device = prompt_mask.device
    ids = torch.tensor([suffix], dtype=torch.long, device=device).expand(prompt_mask.shape[0], -1)
    mask = torch.cat([prompt_mask, torch.ones_like(ids)], dim=1)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions(mask)[:, -ids.shape[1] :],
        **cache_argument(model, cache),
    )
    logits = out.logits.float()
    if first_logits is not None:
        picked = torch.cat([first_logits.float()[:, None, :], logits[:, : answer_len - 1]], dim=1)
    else:
        start = len(suffix) - answer_len - 1
        picked = logits[:, start : start + answer_len]
    return torch.log_softmax(picked, dim=-1)


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
