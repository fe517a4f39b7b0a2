"""The physically compressed KV cache and its attention function."""

from criticalkv.cache.attention import ATTN_IMPLEMENTATION, criticalkv_attention, route_attention
from criticalkv.cache.capture import CaptureCache
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.layer import CompressedLayer

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CaptureCache",
    "CompressedCache",
    "CompressedLayer",
    "criticalkv_attention",
    "route_attention",
]
