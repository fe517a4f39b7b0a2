"""kvpress's presses on transformers' ``QuantizedCache``, the pairing kvpress documents for quantized
storage; used by ``criticalkv bench --kv-bits`` beside our quantized cache.

The quanto backend is kvpress's documented one and is used where ``optimum-quanto`` imports and
stores the bit width (2 or 4 bits); otherwise the HQQ backend (``pip install criticalkv[quant]``;
1, 2, 3, 4 or 8 bits). transformers' layer quantizes everything but the newest ``residual_length``
tokens in ``q_group_size`` groups along one axis and dequantizes the whole layer at every step
(:mod:`criticalkv.bench.hf_quantized`).
"""

from __future__ import annotations

from typing import Any

from criticalkv.bench.hf_quantized import backend_unavailable, hf_quantized_cache, pick_backend
from criticalkv.cache.quantized import DEFAULT_RESIDUAL, KVQuantization

#: the bit widths transformers' quanto ``QuantizedCache`` layer accepts
QUANTO_BITS = (2, 4)


def quanto_unavailable(bits: int) -> str | None:
    """Why kvpress cannot be paired with a quanto ``QuantizedCache`` at ``bits`` here (``None``: it can)."""
    if bits not in QUANTO_BITS:
        return f"transformers' quanto QuantizedCache stores {' or '.join(map(str, QUANTO_BITS))} bits, not {bits}"
    return backend_unavailable("quanto", bits)


def pair_unavailable(bits: int) -> str | None:
    """Why kvpress cannot be paired with any transformers ``QuantizedCache`` (quanto, then HQQ) at
    ``bits`` here (``None``: one of them can)."""
    return pick_backend(bits)[1]


def quantized_cache(model: Any, storage: KVQuantization) -> tuple[Any, str]:
    """transformers' ``QuantizedCache`` for ``model`` at our storage's bits, group size and residual
    (the default residual where it has none), and its backend (quanto where it can, else HQQ)."""
    backend, reason = pick_backend(storage.bits)
    if backend is None:
        raise ValueError(f"no transformers QuantizedCache backend stores {storage.bits} bits here: {reason}")
    length = DEFAULT_RESIDUAL if storage.residual is None else storage.residual
    return hf_quantized_cache(model, backend, storage.bits, storage.group_size, length), backend
