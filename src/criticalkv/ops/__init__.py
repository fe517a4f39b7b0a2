"""Custom torch ops: ``torch.ops.criticalkv.ragged_decode``, decode attention over a ragged,
paged KV layout of 16-bit entries or 8/4-bit codes (:mod:`.ragged_decode`), with its torch
reference (:mod:`.reference`) registered for every device. A faster implementation for a device
is one module that registers itself for it (``torch.library.register_kernel``)."""

from criticalkv.ops.ragged_decode import DECODE_ENV, DECODE_MODES, decode_through_op, mark_fast, ragged_decode
from criticalkv.ops.reference import check_layout, ragged_decode_reference

__all__ = [
    "DECODE_ENV",
    "DECODE_MODES",
    "check_layout",
    "decode_through_op",
    "mark_fast",
    "ragged_decode",
    "ragged_decode_reference",
]
