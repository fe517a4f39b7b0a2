"""16-bit ragged storage: each (batch row, KV head) segment's kept entries as dense tiers
(:mod:`.tiers`), the length buckets a layer decodes from (:mod:`.length_buckets`), their attention
(:mod:`.ragged_attention`) and the storage a layer owns (:mod:`.storage`)."""

from criticalkv.cache.layouts.length_buckets import LengthBuckets
from criticalkv.cache.layouts.ragged_attention import ragged_attention
from criticalkv.cache.layouts.storage import RaggedStorage
from criticalkv.cache.layouts.tiers import RaggedPrefix, Tier, build_prefix, segment_order

__all__ = [
    "LengthBuckets",
    "RaggedPrefix",
    "RaggedStorage",
    "Tier",
    "build_prefix",
    "ragged_attention",
    "segment_order",
]
