"""``torch.ops.criticalkv.ragged_decode``: decode attention over a ragged, paged KV layout.

One call attends one layer's decode queries over every (batch row, KV head) *sequence* at once,
whatever each sequence's length, over 16-bit entries or 8/4-bit codes:

* ``query`` (S, Q, D): sequence ``s``'s ``Q`` query rows (its GQA group's query heads times the
  decode positions, flattened);
* ``key_pool``, ``value_pool`` (P, D) entries, or (P, D * bits / 8) uint8 codes (4 bits: two
  channels a byte, the even channel in the low nibble);
* ``block_table`` (S, M) int32: the pool blocks of each sequence in order (-1 past its end),
  block ``b`` holding pool rows ``[start_b, start_b + block_size)`` where ``start_b`` is
  ``entry_starts[b]`` if given ((NB,) int32: blocks stored without padding, e.g. the partial
  blocks of quantized storage), else ``b * block_size``; ``lengths`` (S,) int32 its entries (a
  last block may be partial: only its first ``lengths - (M_s - 1) * block_size`` rows are read);
* quantized keys: ``key_scale``/``key_zero`` (P / block_size, D), one scale and zero point per
  block and channel; values: ``value_scale``/``value_zero`` (P, D / value_group), per entry and
  group of ``value_group`` channels (KIVI's grouping, Liu et al. 2024, arXiv 2402.02750);
* an optional dense tail ``tail_keys``/``tail_values`` (S, T, D) with ``tail_mask`` (S, Q, T)
  bool (True = attend: causality and padding of appended tokens), every pool entry being visible
  to every query.

The output is (S, Q, D) in ``query.dtype``: ``softmax(scaling * q K^T) V`` over the sequence's
entries and tail, a sequence with nothing to attend giving zeros. The implementation registered
here for every device is the plain torch reference (dequantize, then attend); faster ones register
themselves for their device (``criticalkv.ops.triton_ragged`` for CUDA).
"""

from __future__ import annotations

import os

import torch

from criticalkv.ops.reference import ragged_decode_reference

#: environment variable choosing where decode attention runs: ``auto`` (the op on devices with a
#: fast implementation registered, e.g. CUDA with Triton; the storages' own CPU kernels elsewhere),
#: ``op`` (the op everywhere, its torch reference where nothing faster is registered), ``native``
DECODE_ENV = "CRITICALKV_DECODE"
DECODE_MODES = ("auto", "op", "native")
_FAST_DEVICES: set[str] = set()


def mark_fast(device_type: str) -> None:
    """Record that a fast implementation of the op is registered for ``device_type`` (e.g. ``cuda``)."""
    _FAST_DEVICES.add(device_type)


def decode_through_op(device: torch.device) -> bool:
    """Whether a storage on ``device`` attends through the op (see :data:`DECODE_ENV`)."""
    mode = os.environ.get(DECODE_ENV, "auto")
    if mode not in DECODE_MODES:
        raise ValueError(f"{DECODE_ENV} must be one of {', '.join(DECODE_MODES)}, not {mode!r}")
    return mode == "op" or (mode == "auto" and device.type in _FAST_DEVICES)


#: the op, its schema read off the reference's signature; the reference is its implementation on every device
ragged_decode = torch.library.custom_op("criticalkv::ragged_decode", mutates_args=())(ragged_decode_reference)


@ragged_decode.register_fake
def _ragged_decode_shape(query: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    """The output's shape and dtype: the query's."""
    return torch.empty_like(query)
