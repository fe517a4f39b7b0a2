"""The C kernel's one argument: :class:`DecodeArgs`, the ``CkvDecodeArgs`` struct of
``ragged_decode.c`` field for field (names, types, order). The library reports its own
``sizeof`` and the call sets ``size``, so a kernel built against another layout is refused."""

from __future__ import annotations

import ctypes

_P = ctypes.c_void_p
_I = ctypes.c_int64


class DecodeArgs(ctypes.Structure):
    """Arguments of ``ckv_ragged_decode`` (see ``ragged_decode.c`` for each field's meaning)."""

    _fields_ = [
        ("size", _I),
        *((name, _I) for name in ("S", "Q", "d", "bits", "block_size", "vgroups", "M", "P", "NB", "threads")),
        ("scaling", ctypes.c_double),
        ("query", _P),
        *((name, _P) for name in ("p_k", "p_v", "p_vs", "p_vz", "p_ks", "p_kz")),
        *((name, _P) for name in ("table", "lengths", "entry_starts")),
        ("t", _I),
        ("tail_stride", _I),
        ("tail_k", _P),
        ("tail_v", _P),
        ("mask", _P),
        ("out", _P),
    ]
