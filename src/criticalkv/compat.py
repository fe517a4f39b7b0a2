"""Differences between the transformers 5.x releases we support."""

from __future__ import annotations

import inspect
from typing import Any

_TAKES_CACHE: dict[type, bool] = {}


def _takes_cache_argument(model_class: type) -> bool:
    if model_class not in _TAKES_CACHE:
        forward = getattr(model_class, "forward", None)
        try:
            _TAKES_CACHE[model_class] = forward is not None and "cache" in inspect.signature(forward).parameters
        except (TypeError, ValueError):
            _TAKES_CACHE[model_class] = False
    return _TAKES_CACHE[model_class]


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that passes ``cache`` to ``model(...)`` or ``model.generate(...)``.

    Recent transformers releases name it ``cache`` (``past_key_values`` is deprecated there);
    earlier 5.x releases (5.2, which kvpress 0.5.5 requires) only know ``past_key_values``.
    """
    return {"cache": cache} if _takes_cache_argument(type(model)) else {"past_key_values": cache}
