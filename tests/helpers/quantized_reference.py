"""A reference for the quantized cache: the full cache, kept entries replaced by their
quantize-dequantize values, evicted ones masked (registered as ``quantized_reference``).

It groups entries with one loop per (row, head, block), independently of the cache's batched
staircase: a head's kept prompt entries in position order in blocks of ``group``; the appended
tail's first ``max(0, (t - residual) // group)`` blocks.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from criticalkv.cache.attention import criticalkv_attention
from criticalkv.cache.quantized.codec import dequantize, quantize
from tests.helpers.reference import KEEP, masked_attention


@dataclass
class Quantized:
    keeps: list[torch.Tensor]  # per layer (B, H_kv, T_prompt)
    bits: int
    group: int
    residual: int


QUANT: contextvars.ContextVar[Quantized | None] = contextvars.ContextVar("quant", default=None)


def quantize_dequantize(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """What ``x`` reads back as after the cache's ``quantize`` and ``dequantize`` (in ``x.dtype``)."""
    codes, scale, zero = quantize(x, bits, dim)
    return dequantize(codes, scale, zero, x.dtype)


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


@dataclass
class Shadow:
    """The held reference beside each decode attention of a criticalkv model, from the same query
    and the layer's exact entries (the prompt's and every appended key and value the layer was
    given), so both sides quantize bitwise the same inputs (two separately run models differ by
    float rounding from the second layer on, enough to flip a code now and then).

    ``held`` is set after the prefill; ``real`` (B, q) marks the step's real query rows.
    """

    layers: list[Any]
    held: Held | None = None
    real: torch.Tensor | None = None
    exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    worst: float = 0.0
    followed: int = 0


SHADOW: contextvars.ContextVar[Shadow | None] = contextvars.ContextVar("shadow", default=None)


def shadow_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """criticalkv's attention; under :data:`SHADOW`, also the held reference of the same call:
    records the worst difference and follows the layer's re-selections."""
    shadow = SHADOW.get()
    i = module.layer_idx
    before = None if shadow is None else shadow.layers[i].prefix_len
    out, _ = criticalkv_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if shadow is None:
        return out, None
    if i not in shadow.exact:  # the prefill (full attention): the prompt's exact entries
        shadow.exact[i] = (key.clone(), value.clone())
        return out, None
    held = shadow.held
    assert held is not None and shadow.real is not None
    k, v = (torch.cat([old, new], dim=2) for old, new in zip(shadow.exact[i], (key, value), strict=True))
    shadow.exact[i] = (k, v)
    hk, hv = held.entries(i, k, v)
    token = KEEP.set(held.keeps)
    try:
        ref, _ = masked_attention(module, query, hk, hv, attention_mask, scaling=scaling)
    finally:
        KEEP.reset(token)
    shadow.worst = max(shadow.worst, float((out - ref)[shadow.real].abs().max()))
    layer = shadow.layers[i]
    if layer.prefix_len != before:  # re-selected after this attention: follow it
        held.reselected(i, k, v, layer.keep)
        shadow.followed += 1
    return out, None


AttentionInterface.register("quantized_reference", quantized_reference)
ALL_MASK_ATTENTION_FUNCTIONS.register("quantized_reference", sdpa_mask)
AttentionInterface.register("criticalkv_shadow", shadow_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("criticalkv_shadow", sdpa_mask)
