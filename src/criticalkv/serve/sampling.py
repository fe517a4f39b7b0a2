"""Choosing a chat answer's next token: greedy, or sampled with temperature and top-p.

Each answer draws from its own ``torch.Generator`` (seeded by the request's ``seed``, else at
random), never from the global RNG, so a seeded answer is the same alone or batched with others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """A request's decoding options: ``temperature`` 0 is greedy (``top_p`` and ``seed`` unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """A boolean mask over ``probs`` (V,): the smallest set of the most probable tokens whose
    probabilities sum to at least ``top_p`` (the most probable token is always kept)."""
    order = torch.argsort(probs, descending=True, stable=True)
    sorted_probs = probs[order]
    before = torch.cumsum(sorted_probs, 0) - sorted_probs  # the mass of the more probable tokens
    keep_sorted = before < top_p
    keep_sorted[0] = True
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


class TokenChooser:
    """One answer's token choice: ``argmax`` when greedy, else a draw from its own generator."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.generator: torch.Generator | None = None
        if not sampling.greedy:
            self.generator = torch.Generator()
            if sampling.seed is None:
                self.generator.seed()  # a non-deterministic seed of its own
            else:
                self.generator.manual_seed(sampling.seed)

    def choose(self, logits: torch.Tensor) -> int:
        """The next token after the (V,) ``logits``."""
        if self.generator is None:
            return int(logits.argmax())
        probs = torch.softmax(logits.detach().to("cpu", torch.float64) / self.sampling.temperature, dim=-1)
        if self.sampling.top_p < 1:
            probs = torch.where(top_p_keep(probs, self.sampling.top_p), probs, torch.zeros_like(probs))
        return int(torch.multinomial(probs, 1, generator=self.generator))
