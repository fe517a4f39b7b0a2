"""transformers' own ``QuantizedCache`` (quanto or HQQ backend): which backend can run here, and
the cache (its real bytes: :func:`criticalkv.bench.ours.dynamic_cache_bytes`).

transformers' quantized layer (KIVI-like, Liu et al. 2024, arXiv 2402.02750) quantizes a whole
prompt at its first ``update`` (the prefill itself attends to the exact states), keeps later
tokens exact until ``residual_length`` of them are held, then re-quantizes everything together.
Both keys and values are grouped along ``axis_key``/``axis_value`` (default 0) in groups of
``q_group_size``. quanto stores 2 or 4 bits; HQQ 1, 2, 3, 4 or 8 bits, with a scale and zero point
per group in the model's dtype (float32 for a float32 model). Neither evicts anything.
"""

from __future__ import annotations

import importlib
from typing import Any

#: the bit widths each transformers ``QuantizedCache`` backend accepts, in order of preference
HF_BACKEND_BITS: dict[str, tuple[int, ...]] = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
#: what transformers' layer of each backend imports (module, names), and the package that provides it
_NEEDS = {
    "quanto": ("optimum.quanto", ("MaxOptimizer", "quantize_weight", "qint4"), "optimum-quanto"),
    "hqq": ("hqq.core.quantize", ("Quantizer",), "hqq"),
}


def backend_unavailable(backend: str, bits: int) -> str | None:
    """Why transformers' ``QuantizedCache`` cannot use ``backend`` at ``bits`` here (``None``: it can)."""
    if backend not in HF_BACKEND_BITS:
        raise ValueError(f"transformers' QuantizedCache backends are {', '.join(HF_BACKEND_BITS)}, not {backend!r}")
    accepted = HF_BACKEND_BITS[backend]
    if bits not in accepted:
        return f"transformers' {backend} QuantizedCache stores {', '.join(map(str, accepted))} bits, not {bits}"
    module, names, package = _NEEDS[backend]
    try:  # the names too: an uninstall can leave an empty namespace package that imports
        loaded = importlib.import_module(module)
        for name in names:
            getattr(loaded, name)
    except Exception as err:  # ImportError, AttributeError
        return f"{package} does not import ({type(err).__name__}: {err}); pip install {package} to use it"
    return None


def pick_backend(bits: int, order: tuple[str, ...] = ("quanto", "hqq")) -> tuple[str | None, str | None]:
    """``(backend, None)``: the first backend of ``order`` that can store ``bits`` here; ``(None,
    reasons)`` when none can, every backend's reason in one sentence."""
    reasons = []
    for backend in order:
        reason = backend_unavailable(backend, bits)
        if reason is None:
            return backend, None
        reasons.append(reason)
    return None, "; ".join(reasons)


def hf_quantized_cache(model: Any, backend: str, bits: int, group: int, residual: int) -> Any:
    """transformers' ``QuantizedCache`` for ``model``: ``backend`` at ``bits``, ``group`` entries per
    scale and zero point, the newest ``residual`` appended tokens exact.

    Raises
    ------
    ValueError
        If the backend cannot run here or does not store ``bits`` (the sentence says which, and why).
    """
    reason = backend_unavailable(backend, bits)
    if reason is not None:
        raise ValueError(reason)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"the quantization group size must be a positive integer, not {group!r}")
    if isinstance(residual, bool) or not isinstance(residual, int) or residual < 1:
        raise ValueError(f"transformers' residual_length must be a positive integer, not {residual!r}")
    from transformers import QuantizedCache

    return QuantizedCache(backend, model.config, nbits=bits, q_group_size=group, residual_length=residual)
