"""Several compressed caches as the rows of one batch: separate caches decoded together
(:mod:`.rows_cache`), several compressions of one prompt stacked as rows (:mod:`.stacked`), and
prompts compressed in one batch split into single-row caches (:mod:`.split`)."""

from criticalkv.cache.batch.rows_cache import RowsCache, RowsLayer
from criticalkv.cache.batch.split import split_rows
from criticalkv.cache.batch.stacked import decode_budget_cache, keep_masks, row_kv_bytes, stacked_cache

__all__ = ["RowsCache", "RowsLayer", "decode_budget_cache", "keep_masks", "row_kv_bytes", "split_rows", "stacked_cache"]
