"""Quantized storage of kept entries (``kv_bits`` 8 or 4, KIVI-style groups): the spec
(:mod:`.spec`), the codec (:mod:`.codec`), blocks of codes (:mod:`.blocks`, :mod:`.partial`), the
quantized prefix (:mod:`.prefix`, :mod:`.pool`), its decode plan and attention (:mod:`.plan`,
:mod:`.attention`, the C kernel in :mod:`.kernels`), the layer (:mod:`.layer`) and the tensors
it saves (:mod:`.persist`)."""

from criticalkv.cache.quantized.blocks import empty_blocks
from criticalkv.cache.quantized.layer import QuantizedLayer, make_layer
from criticalkv.cache.quantized.persist import quantized_header, quantized_tensors, restore_prefix, restore_tail
from criticalkv.cache.quantized.prefix import QuantizedPrefix
from criticalkv.cache.quantized.spec import (
    DEFAULT_GROUP_SIZES,
    DEFAULT_RESIDUAL,
    KVQuantization,
    bits_per_element,
    check_quantized_decode,
    default_group_size,
    quantization_for,
    storage_options,
)

__all__ = [
    "DEFAULT_GROUP_SIZES",
    "DEFAULT_RESIDUAL",
    "KVQuantization",
    "QuantizedLayer",
    "QuantizedPrefix",
    "bits_per_element",
    "check_quantized_decode",
    "default_group_size",
    "empty_blocks",
    "make_layer",
    "quantization_for",
    "quantized_header",
    "quantized_tensors",
    "restore_prefix",
    "restore_tail",
    "storage_options",
]
