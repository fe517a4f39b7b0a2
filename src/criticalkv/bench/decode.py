"""Greedy decoding steps timed on any cache (ours, transformers' or kvpress's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from criticalkv.bench.measure import now
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
