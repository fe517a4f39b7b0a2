"""The C decode kernel's one argument: :class:`DecodeArgs`, the ``CkvDecodeArgs`` struct of
``quantized_decode.c`` field for field (names, types, order). The library reports its own
``sizeof`` and the call sets ``size``, so a kernel built against another layout is refused."""

from __future__ import annotations

import ctypes

_P = ctypes.c_void_p
_I = ctypes.c_int64


class DecodeArgs(ctypes.Structure):
    """Arguments of ``ckv_quantized_decode`` (see ``quantized_decode.c`` for each field's meaning)."""

    _fields_ = [
        ("size", _I),
        *((name, _I) for name in ("S", "Q", "d", "bits", "group", "vgroups", "threads")),
        ("scaling", ctypes.c_double),
        ("query", _P),
        ("perm", _P),
        *((name, _P) for name in ("p_kc", "p_vc", "p_vs", "p_vz", "p_ks", "p_kz")),
        *((name, _P) for name in ("seg_offsets", "blk_entry", "blk_row", "blk_len")),
        ("tail_used", _I),
        ("tail_cap", _I),
        *((name, _P) for name in ("t_kc", "t_ks", "t_kz", "t_vc", "t_vs", "t_vz")),
        ("r", _I),
        ("res_stride", _I),
        ("res_k", _P),
        ("res_v", _P),
        ("mask", _P),
        ("mask_t", _I),
        ("out", _P),
    ]
