"""Saving a compressed cache and loading it back: the file format (:mod:`.cache_file`), model and
tokenizer fingerprints (:mod:`.fingerprint`) and atomic writes (:mod:`.atomic_write`)."""

from criticalkv.cache.persist.cache_file import (
    FORMAT_VERSION,
    CacheFileError,
    IncompatibleCacheError,
    load_cache,
    read_header,
    save_cache,
)
from criticalkv.cache.persist.fingerprint import model_fingerprint, tokenizer_fingerprint

__all__ = [
    "FORMAT_VERSION",
    "CacheFileError",
    "IncompatibleCacheError",
    "load_cache",
    "model_fingerprint",
    "read_header",
    "save_cache",
    "tokenizer_fingerprint",
]
