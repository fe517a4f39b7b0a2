"""Where a compressed request's kept entries go in vLLM's paged KV cache.

One layer's cache in vLLM's CPU attention backend is ``(num_blocks, H_kv, block_size, 2 * head_dim)``:
each (block, KV head) is one contiguous slice holding that head's ``block_size`` keys and values,
in a layout of the backend's own choosing (it may pack them for the CPU's vector units). The plugin
never reads that layout: it writes with vLLM's own cache-update op, through a view in which every
(block, KV head) slice is a one-head block (:func:`head_blocks`), so each KV head can store *other*
positions at the same cache index. A request's *block table* lists its blocks in order; its entry
``i`` lives in block ``table[i // block_size]`` at offset ``i % block_size``. Pure torch: the tests
check it without vLLM.
"""

from __future__ import annotations

import torch


def head_blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """``kv_cache`` (num_blocks, H_kv, block_size, C) viewed as (num_blocks * H_kv, 1, block_size, C):
    one-head block ``b * H_kv + h`` is KV head ``h`` of block ``b``."""
    if kv_cache.dim() != 4 or not kv_cache.is_contiguous():
        raise ValueError(
            "expected vLLM's CPU KV cache layout, a contiguous (num_blocks, kv_heads, block_size, 2 * head_dim) "
            f"tensor, got shape {tuple(kv_cache.shape)}"
        )
    blocks, heads, block_size, channels = kv_cache.shape
    return kv_cache.view(blocks * heads, 1, block_size, channels)


def compacted_slots(compacted: torch.Tensor, heads: int, count: int, block_size: int) -> torch.Tensor:
    """(H_kv, count) the slots, in :func:`head_blocks`'s view, of entries ``0 .. count - 1`` of every
    KV head of a request whose block table is ``compacted``."""
    used = -(-count // block_size)
    if used > compacted.numel():
        raise ValueError(f"{count} entries need {used} blocks, the block table has {compacted.numel()}")
    index = torch.arange(count)
    blocks = compacted.long()[index // block_size]  # (count,)
    head = torch.arange(heads)[:, None]
    return (blocks[None, :] * heads + head) * block_size + index % block_size


def compaction_order(keep: torch.Tensor, computed: int) -> torch.Tensor:
    """(H_kv, kept + computed - T) for each head, the positions of its kept prompt entries in order
    (``keep``: (H_kv, T) bool, the same count per head), then the positions ``T .. computed - 1``
    computed after the prompt (a request prefilled again after preemption has some)."""
    heads, prompt = keep.shape
    counts = keep.sum(-1)
    kept = int(counts[0])
    if not bool((counts == kept).all()):
        raise ValueError(f"the plugin needs the same number of kept entries per KV head, got {counts.tolist()}")
    positions = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[:, :kept]
    tail = torch.arange(prompt, computed, device=keep.device).expand(heads, -1)
    return torch.cat([positions, tail], dim=-1)


def gather_heads(entries: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(H_kv, n, d) each head's ``entries`` (H_kv, T', d) at its positions ``order`` (H_kv, n)."""
    index = order[..., None].expand(-1, -1, entries.shape[-1]).to(entries.device)
    return entries.gather(1, index)
