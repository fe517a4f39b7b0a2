"""Quantized storage of kept entries: ``kv_bits`` 8 or 4 in KIVI-style groups, with the spec
(:mod:`.precision`), the codec (:mod:`.codec`), blocks of codes (:mod:`.code_blocks`, :mod:`.partial`), the
quantized prefix (:mod:`.prefix`, :mod:`.pool`) and its block table for the decode op
(:mod:`.paged`; the op and its C kernel are in :mod:`criticalkv.ops`), the storage
(:mod:`.storage`) and the tensors it saves (:mod:`.persist`)."""

from criticalkv.cache.quantized.precision import (
    DEFAULT_GROUP_SIZES,
    DEFAULT_RESIDUAL,
    KVQuantization,
    bits_per_element,
    check_quantized_decode,
    default_group_size,
    head_dim_of,
    quantization_for,
    quantization_from_record,
    storage_options,
)
from criticalkv.cache.quantized.storage import QuantizedStorage

__all__ = [
    "DEFAULT_GROUP_SIZES",
    "DEFAULT_RESIDUAL",
    "KVQuantization",
    "QuantizedStorage",
    "bits_per_element",
    "check_quantized_decode",
    "default_group_size",
    "head_dim_of",
    "quantization_for",
    "quantization_from_record",
    "storage_options",
]
