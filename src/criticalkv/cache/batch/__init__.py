"""Several compressed caches as the rows of one batch: separate caches decoded together
(:mod:`.rows`) and several compressions of one prompt stacked as rows (:mod:`.stacked`)."""

from criticalkv.cache.batch.rows import RowsCache, RowsLayer
from criticalkv.cache.batch.stacked import decode_budget_cache, keep_masks, row_kv_bytes, stacked_cache

__all__ = ["RowsCache", "RowsLayer", "decode_budget_cache", "keep_masks", "row_kv_bytes", "stacked_cache"]
