"""The physically compressed KV cache and its attention function."""

from criticalkv.cache.attention import ATTN_IMPLEMENTATION, criticalkv_attention, route_attention
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.layer import CompressedLayer
from criticalkv.cache.prefill import CaptureCache
from criticalkv.cache.spec import CacheSpec, DecodeBudget, PromptTooShort, bind_spec
from criticalkv.cache.storage import Geometry, Storage
from criticalkv.cache.storage_table import STORAGES, new_storage, storage_class

__all__ = [
    "ATTN_IMPLEMENTATION",
    "STORAGES",
    "CacheSpec",
    "CaptureCache",
    "CompressedCache",
    "CompressedLayer",
    "DecodeBudget",
    "Geometry",
    "PromptTooShort",
    "Storage",
    "bind_spec",
    "criticalkv_attention",
    "new_storage",
    "route_attention",
    "storage_class",
]
