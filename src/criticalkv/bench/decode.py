"""Greedy decoding steps timed on any cache (ours, transformers' or kvpress's): one cache decoding
on its own (:func:`timed_decode`, ``criticalkv bench``), or several in lockstep (:class:`Lockstep`,
``benchmarks/``'s decode scripts: every cache appends the same token in turn, at the same moment)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from criticalkv.bench.instruments import now
from criticalkv.cache import CacheSpec, CompressedCache, bind_spec
from criticalkv.compat import cache_argument
from criticalkv.methods import get_method
from criticalkv.runtime.forward import append_tokens


@torch.no_grad()
def timed_decode(
    model: Any,
    cache: Any,
    first_token: torch.Tensor,
    context_tokens: int,
    steps: int,
    after_step: Callable[[], None] | None = None,
    tokens: list[torch.Tensor] | None = None,
) -> float:
    """Decode ``steps`` greedy tokens after one untimed warm-up step; mean seconds per step.

    ``first_token`` is (B,) the argmax after the prompt; every row has ``context_tokens``
    prompt tokens (no padding), so positions continue at ``context_tokens``. ``after_step`` is
    called after every step (the warm-up one too), outside the timed span: each step is then
    timed on its own and the steps' times are summed. ``tokens``, if given, receives each step's
    (B, 1) greedy token (``steps + 1`` of them).
    """
    if steps < 1:
        raise ValueError("decode steps must be at least 1")
    device = first_token.device
    batch = int(first_token.shape[0])
    token = first_token.view(batch, 1)
    mask = torch.ones(batch, context_tokens, dtype=torch.long, device=device)
    start, spent = 0.0, 0.0
    for step in range(steps + 1):
        if step == 1 or (after_step is not None and step > 0):
            start = now(device)
        out, mask = append_tokens(model, cache, mask, token)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if tokens is not None:
            tokens.append(token)
        if after_step is not None:
            spent += now(device) - start if step > 0 else 0.0
            after_step()
    return (spent if after_step is not None else now(device) - start) / steps


def greedy_ids(first_token: torch.Tensor, tokens: list[torch.Tensor]) -> list[list[int]]:
    """Each row's greedy tokens: ``first_token`` (B,), the argmax after the prompt, then the
    (B, 1) ``tokens`` :func:`timed_decode` collected."""
    batch = int(first_token.shape[0])
    return [[int(t) for t in row] for row in torch.cat([first_token.view(batch, 1), *tokens], dim=1).cpu()]


def prefill_logits(model: Any, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    """Prefill ``cache`` with the (B, T) unpadded prompt ``ids``: the last position's (B, V) logits."""
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_argument(model, cache), logits_to_keep=1)
    return out.logits[:, -1]


@dataclass
class Lockstep:
    """Caches that hold the same (B, T) unpadded prompt and append the same token per step: the
    attention mask they share and the position of the step's token. :meth:`advance` once per step
    (untimed), then :meth:`step` each cache (time it around the call)."""

    mask: torch.Tensor
    position: torch.Tensor = field(init=False)

    @classmethod
    def after(cls, ids: torch.Tensor) -> Lockstep:
        """The lockstep of caches prefilled with ``ids``."""
        return cls(torch.ones_like(ids))

    def advance(self) -> None:
        """One more token on every row: the mask grows by a column and the position moves to it."""
        rows, device = self.mask.shape[0], self.mask.device
        self.mask = torch.cat([self.mask, torch.ones(rows, 1, dtype=self.mask.dtype, device=device)], dim=1)
        self.position = torch.full((rows, 1), self.mask.shape[1] - 1, device=device)

    def step(self, model: Any, cache: Any, token: torch.Tensor) -> torch.Tensor:
        """Append the (B, 1) ``token`` to ``cache`` at this step's position: its (B, V) logits."""
        cache_kwargs = cache_argument(model, cache)
        out = model(input_ids=token, attention_mask=self.mask, position_ids=self.position, **cache_kwargs)
        return out.logits[:, -1]


def held_caches(model: Any, methods: list[str], spec: CacheSpec) -> dict[str, CompressedCache]:
    """The full cache (at ``spec``'s window), then one cache per method as ``spec`` describes it (its
    prefill budget, window, decode budget and storage), bound to ``model``: what the long-generation
    scripts step in lockstep."""
    layers = model.config.num_hidden_layers
    caches = {"full": CompressedCache.from_spec(layers, CacheSpec(get_method("full"), 1.0, spec.window))}
    for method in methods:
        caches[method] = CompressedCache.from_spec(layers, bind_spec(spec.replaced(method=method), model))
    return caches


def step_metrics(reference: torch.Tensor, logits: torch.Tensor, token: int) -> dict[str, Any]:
    """Against the (1, V) log-probabilities ``reference`` of the step that chose ``token``: the NLL of
    ``token`` under ``logits``, top-1 agreement and KL(reference || logits)."""
    lp = torch.log_softmax(logits, dim=-1)
    return {
        "nll": float(-lp[0, token]),
        "top1": int(lp.argmax(-1)) == token,
        "kl": float((reference.exp() * (reference - lp)).sum()),
    }
