"""Forking a compressed cache: a copy sharing the compressed prompt, with an empty tail."""

from __future__ import annotations

from typing import Any

from criticalkv.cache.quantized import QuantizedLayer, storage_options


def fork_cache(cache: Any) -> Any:
    """What :meth:`CompressedCache.fork` returns (see there); typed loosely, as this module sits
    below :mod:`~criticalkv.cache.compressed_cache`."""
    clone = type(cache)(
        cache.num_layers, cache.method, cache.budget, cache.window, **storage_options(cache.quantization)
    )
    if cache.decode is not None:  # its own decode budget: the two decode independently
        clone.decode = cache.decode.fork()
        clone.decode.install(clone.compressed_layers)
    clone.real_prompt_tokens = cache.real_prompt_tokens
    clone._budget_tokens = cache._budget_tokens
    clone.tokens = cache.tokens.head(cache.compressed_layers[0].prefix_len)
    for mine, theirs in zip(cache.compressed_layers, clone.compressed_layers, strict=True):
        if mine.prefix is None:
            raise ValueError("only a cache that already holds a compressed prompt can be forked")
        mine.settle()  # the clone shares the tiers (length buckets hold them otherwise)
        theirs.prefix, theirs.keep, theirs.prefix_len = mine.prefix, mine.keep, mine.prefix_len
        theirs.batch_size, theirs.num_kv_heads, theirs.head_dim = mine.batch_size, mine.num_kv_heads, mine.head_dim
        theirs.device, theirs.dtype, theirs.is_initialized = mine.device, mine.dtype, True
        theirs.owns_prefix = False  # shared read-only: appends go to the clone's own tail
        if isinstance(mine, QuantizedLayer) and isinstance(theirs, QuantizedLayer):
            theirs.residual = mine.residual
    return clone
