"""kvpress's presses on transformers' ``QuantizedCache`` (quanto backend), the pairing kvpress
documents for quantized storage; used by ``criticalkv bench --kv-bits`` beside our quantized cache.

transformers' quanto layer quantizes everything but the newest ``residual_length`` tokens in
``q_group_size`` groups along one axis and dequantizes the whole layer at every step; it stores
2 or 4 bits (``optimum-quanto`` must import).
"""

from __future__ import annotations

from typing import Any

from criticalkv.bench.ours import StorageOptions
from criticalkv.cache.quant_spec import DEFAULT_RESIDUAL

#: the bit widths transformers' quanto ``QuantizedCache`` layer accepts
QUANTO_BITS = (2, 4)


def quanto_unavailable(bits: int) -> str | None:
    """Why kvpress cannot be paired with a quanto ``QuantizedCache`` at ``bits`` here (``None``: it can)."""
    if bits not in QUANTO_BITS:
        return f"transformers' quanto QuantizedCache stores {' or '.join(map(str, QUANTO_BITS))} bits, not {bits}"
    try:
        from optimum.quanto import MaxOptimizer, quantize_weight  # noqa: F401  what the cache layer calls
    except Exception as err:  # ImportError, or a namespace package left by an uninstall
        return f"optimum-quanto does not import ({type(err).__name__}: {err}); pip install optimum-quanto to pair them"
    return None


def quanto_cache(model: Any, storage: StorageOptions) -> Any:
    """transformers' ``QuantizedCache`` (quanto) for ``model`` at (bits, group size, residual)."""
    from transformers import QuantizedCache

    bits, group, residual = storage
    reason = quanto_unavailable(bits)
    if reason is not None:
        raise ValueError(reason)
    length = DEFAULT_RESIDUAL if residual is None else residual
    return QuantizedCache("quanto", model.config, nbits=bits, q_group_size=group, residual_length=length)
