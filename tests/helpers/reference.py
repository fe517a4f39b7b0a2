"""Reference implementations the tests compare against."""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

# per layer: (B, H_kv, T_prompt) bool mask of kept prompt entries
KEEP: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar("keep", default=None)


def masked_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention over the *full* cache, with evicted prompt entries masked to -inf."""
    b, h_q, q, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    g = h_q // h_kv
    k = key.repeat_interleave(g, dim=1)
    v = value.repeat_interleave(g, dim=1)
    # float64 softmax and mixing; MPS has no float64, so there it stays in float32
    exact = torch.float32 if query.device.type == "mps" else torch.float64
    scores = torch.matmul(query, k.transpose(-1, -2)).to(exact) * (scaling or d**-0.5)
    allowed = torch.ones(b, h_q, q, t, dtype=torch.bool, device=query.device)
    if attention_mask is not None:
        allowed &= attention_mask[:, :, -q:, :t].expand(b, h_q, q, t)
    else:
        past = t - q
        positions = torch.arange(t, device=query.device)
        allowed &= positions[None, :] <= past + positions[:q, None]
    keeps = KEEP.get()
    if keeps is not None:
        keep = keeps[module.layer_idx].repeat_interleave(g, dim=1)  # (B, H_q, T_prompt)
        allowed[..., : keep.shape[-1]] &= keep[:, :, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.matmul(weights, v.to(exact)).to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register("masked_reference", masked_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("masked_reference", sdpa_mask)
