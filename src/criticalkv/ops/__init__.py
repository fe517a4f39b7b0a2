"""Custom torch ops: ``torch.ops.criticalkv.ragged_decode``, decode attention over a ragged,
paged KV layout of 16-bit entries or 8/4-bit codes (:mod:`.ragged_decode`), with its torch
reference (:mod:`.reference`) registered for every device. A faster implementation for a device
is one module that registers itself for it (``torch.library.register_kernel``): the C kernel
(:mod:`.cpu`) for CPU, and the Triton kernel (:mod:`.triton_ragged`) for CUDA, imported here on
GPU builds of torch (a no-op without triton)."""

import logging

import torch

from criticalkv.ops.cpu import ragged_decode_cpu  # noqa: F401  (registers the C kernel as the op's CPU implementation)
from criticalkv.ops.ragged_decode import DECODE_ENV, DECODE_MODES, decode_through_op, mark_fast, ragged_decode
from criticalkv.ops.reference import check_layout, ragged_decode_reference

if torch.version.cuda is not None or torch.version.hip is not None:  # CPU builds skip importing triton
    try:
        from criticalkv.ops import triton_ragged  # noqa: F401  (registers the CUDA kernel where triton imports)
    except Exception as error:  # a broken triton install leaves the op its torch reference
        logging.getLogger(__name__).warning("the Triton kernel of the ragged decode op is not registered: %s", error)

__all__ = [
    "DECODE_ENV",
    "DECODE_MODES",
    "check_layout",
    "decode_through_op",
    "mark_fast",
    "ragged_decode",
    "ragged_decode_reference",
]
