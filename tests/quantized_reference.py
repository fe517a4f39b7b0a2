"""A reference for the quantized cache: the full cache, kept entries replaced by their
quantize-dequantize values, evicted ones masked (registered as ``quantized_reference``).

It groups entries with one loop per (row, head, block), independently of the cache's batched
staircase: a head's kept prompt entries in position order in blocks of ``group``; the appended
tail's first ``max(0, (t - residual) // group)`` blocks.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from criticalkv.cache.quantize import quantize_dequantize
from tests.reference import masked_attention


@dataclass
class Quantized:
    keeps: list[torch.Tensor]  # per layer (B, H_kv, T_prompt)
    bits: int
    group: int
    residual: int


QUANT: contextvars.ContextVar[Quantized | None] = contextvars.ContextVar("quant", default=None)


def qdq_entries(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, d) entries of one block: keys per channel over the entries, values per token per
    ``min(group, d)`` channels."""
    n, d = values.shape
    gv = min(group, d)
    k = quantize_dequantize(keys, bits, dim=0)
    v = quantize_dequantize(values.reshape(n, d // gv, gv), bits, dim=-1).reshape(n, d)
    return k, v


def quantize_like_cache(
    key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor, bits: int, group: int, residual: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, T, d) full keys/values -> what the quantized cache holds for each position."""
    key, value = key.clone(), value.clone()
    b, h, t, _ = key.shape
    prompt = keep.shape[-1]
    tail = t - prompt
    tail_blocks = max(0, (tail - residual) // group)
    for i in range(b):
        for j in range(h):
            kept = torch.nonzero(keep[i, j]).flatten().tolist()
            chunks = [kept[c : c + group] for c in range(0, len(kept), group)]
            chunks += [list(range(prompt + c * group, prompt + (c + 1) * group)) for c in range(tail_blocks)]
            for chunk in chunks:
                index = torch.tensor(chunk, device=key.device)
                k, v = qdq_entries(key[i, j, index], value[i, j, index], bits, group)
                key[i, j, index], value[i, j, index] = k, v
    return key, value


def quantized_reference(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    spec = QUANT.get()
    if spec is not None:
        keep = spec.keeps[module.layer_idx]
        key, value = quantize_like_cache(key, value, keep, spec.bits, spec.group, spec.residual)
    return masked_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


@dataclass
class Held:
    """What a quantized cache under a decode budget holds, simulated per layer from the exact
    entries: after each re-selection the kept entries are quantized again, in blocks of the new
    selection, from the values the layer held (its quantized ones dequantized, its residual exact).

    ``keeps[l]`` (B, H_kv, P_l) marks the kept positions of layer ``l``'s prefix region (the first
    ``P_l`` positions); ``prefix[l]`` the values held there (``None``: the prompt, not yet quantized).
    Positions from ``P_l`` on are the tail, quantized as the cache quantizes its tail.
    """

    keeps: list[torch.Tensor]
    bits: int
    group: int
    residual: int
    prefix: list[tuple[torch.Tensor, torch.Tensor] | None]

    def entries(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, T, d) exact keys/values -> what layer ``layer`` holds at each position."""
        keep = self.keeps[layer]
        p = keep.shape[-1]
        if self.prefix[layer] is None:
            self.prefix[layer] = quantize_like_cache(key[:, :, :p], value[:, :, :p], keep, self.bits, self.group, 0)
        held = self.prefix[layer]
        assert held is not None
        k, v = quantize_like_cache(key, value, keep, self.bits, self.group, self.residual)
        k[:, :, :p], v[:, :, :p] = held
        return k, v

    def reselected(self, layer: int, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor) -> None:
        """Layer ``layer`` re-selected ``keep`` (B, H, T) over everything it held (exact ``key``/``value``)."""
        k, v = self.entries(layer, key, value)
        self.prefix[layer] = quantize_like_cache(k, v, keep, self.bits, self.group, 0)
        self.keeps[layer] = keep


HELD: contextvars.ContextVar[Held | None] = contextvars.ContextVar("held", default=None)


def held_reference(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked full cache over what :data:`HELD` says each position holds (set ``KEEP`` too)."""
    held = HELD.get()
    if held is not None:
        key, value = held.entries(module.layer_idx, key, value)
    return masked_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register("quantized_reference", quantized_reference)
ALL_MASK_ATTENTION_FUNCTIONS.register("quantized_reference", sdpa_mask)
AttentionInterface.register("held_reference", held_reference)
ALL_MASK_ATTENTION_FUNCTIONS.register("held_reference", sdpa_mask)
