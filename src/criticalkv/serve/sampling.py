"""Choosing a chat answer's next token: greedy, or sampled with temperature and top-p.

Each answer draws from its own ``torch.Generator`` (seeded by the request's ``seed``, else at
random), never from the global RNG, so a seeded answer is the same alone or batched with others.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: how many of the most probable tokens :func:`nucleus` looks at before sorting them all
_TOP_K = (64, 1024)


@dataclass(frozen=True)
class Sampling:
    """A request's decoding options: ``temperature`` 0 is greedy (``top_p`` and ``seed`` unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of the most probable tokens of ``probs`` (V,) whose probabilities sum to
    at least ``top_p`` (the most probable token is always in it): (their ids, their
    probabilities), most probable first. Looks at the top 64, then the top 1,024, and sorts the
    whole vocabulary only when their mass falls short of ``top_p`` (a nearly flat distribution)."""
    for k in _TOP_K:
        if k < probs.numel():
            values, ids = probs.topk(k)
            if float(values.sum()) >= top_p:
                break  # the tokens past the top k would not be kept
    else:  # numpy's argsort is about 3x faster than torch.sort on the CPU here (ties: in a fixed order)
        ids = torch.from_numpy(np.argsort(-probs.numpy()))
        values = probs[ids]
    keep = torch.cumsum(values, 0) - values < top_p  # the mass of the more probable tokens
    keep[0] = True
    return ids[keep], values[keep]


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
        ids: torch.Tensor | None = None
        if self.sampling.top_p < 1:
            ids, probs = nucleus(probs, self.sampling.top_p)
        # inverse transform sampling: the first token whose cumulative probability exceeds u
        cumulative = torch.cumsum(probs, 0)
        u = torch.rand((), generator=self.generator, dtype=torch.float64) * cumulative[-1]
        at = min(int(torch.searchsorted(cumulative, u, right=True)), probs.numel() - 1)
        return at if ids is None else int(ids[at])
