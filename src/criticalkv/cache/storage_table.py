"""The storage table: which :class:`~criticalkv.cache.storage.Storage` holds a cache's entries, by
the type of the storage part of its spec (:attr:`CacheSpec.storage <criticalkv.cache.spec.CacheSpec>`).

A new storage (fp8, a paged GPU layout) is its subpackage of ``cache/`` (a spec type and a
``Storage`` built as ``cls(spec)``) plus one line in :data:`STORAGES`; the layer, the cache, files
and the server's memory accounting ask this table and nothing else.
"""

from __future__ import annotations

from typing import Any

from criticalkv.cache.layouts import RaggedStorage
from criticalkv.cache.quantized import KVQuantization, QuantizedStorage
from criticalkv.cache.storage import Storage

#: storage spec type -> the storage that holds its entries
STORAGES: dict[type, type[Storage]] = {
    type(None): RaggedStorage,  # no storage spec: the model's dtype, in 16-bit ragged layouts
    KVQuantization: QuantizedStorage,  # kv_bits 8 or 4
}


def storage_class(spec: Any) -> type[Storage]:
    """The storage implementation for the storage part of a cache's spec (``None``: the model's dtype)."""
    found = STORAGES.get(type(spec))
    if found is None:
        known = ", ".join(kind.__name__ for kind in STORAGES)
        raise TypeError(f"no storage holds a {type(spec).__name__} storage spec (known: {known}); add it to STORAGES")
    return found


def new_storage(spec: Any = None) -> Storage:
    """An empty storage for the storage part of a cache's spec (``None``: the model's dtype)."""
    return storage_class(spec)(spec)
