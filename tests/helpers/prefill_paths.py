"""One way for the shared tests to compress a prompt with any registered method.

Most methods compress inside the model's own prefill (a :class:`CompressedCache` passed to the
forward). Methods that need a context-reconstruction pass (``needs.reconstruction``: KVzip) cannot:
the runtime captures the prefill, runs the pass and compresses the captured states
(:func:`criticalkv.runtime.capture_prefill` with ``reconstruction``, then
:meth:`CompressedCache.from_states`).
"""

from __future__ import annotations

from typing import Any

import torch

import criticalkv as ckv
from criticalkv.compat import cache_argument
from criticalkv.prompts import positions
from criticalkv.runtime import RepeatPrompt, capture_prefill

#: the repeat prompt used on the tiny random models (token ids of their vocabulary)
TINY_REPEAT = RepeatPrompt((5, 6, 7, 8))


@torch.no_grad()
def compressed_prefill(
    model: Any,
    method: str,
    budget: float,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    window: int,
    head_scores: Any = None,
) -> tuple[ckv.CompressedCache, torch.Tensor]:
    """The compressed cache of ``ids`` and the prefill's (B, T, V) logits."""
    bound = ckv.bind(ckv.get_method(method), model, head_scores)
    if bound.needs.reconstruction:
        n = int(ids.shape[1])
        states, logits = capture_prefill(
            model, ids, mask, window=window, num_queries=n, logits_to_keep=n, reconstruction=TINY_REPEAT
        )
        return ckv.CompressedCache.from_states(states, bound, budget, window=window), logits
    cache = ckv.CompressedCache(model.config.num_hidden_layers, bound, budget, window=window)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **cache_argument(model, cache))
    return cache, out.logits
