"""Hand-off between a cache layer's ``update`` and the attention function that follows it.

transformers calls ``cache.update(k, v, layer_idx)`` and then the attention function for the
same layer, back to back, in the same thread. A criticalkv layer announces itself here in
``update``; the ``criticalkv`` attention function claims it. No state lives on the model.
"""

from __future__ import annotations

import contextvars
from typing import Any

_PENDING: contextvars.ContextVar[Any] = contextvars.ContextVar("criticalkv_pending_layer", default=None)

NOT_ATTACHED = (
    "a criticalkv cache was used but the model does not route attention through criticalkv; "
    "call criticalkv.attach(model) once before generating (it sets attn_implementation='criticalkv')"
)


def announce(layer: Any, layer_idx: int) -> None:
    """Called by a layer's ``update``: its attention call comes next."""
    stale = _PENDING.get()
    # unclaimed: a later layer of the same forward, or the same layer again (a one-layer model)
    if stale is not None and (layer_idx != 0 or stale is layer):
        _PENDING.set(None)
        raise RuntimeError(NOT_ATTACHED)
    _PENDING.set(layer)


def claim() -> Any:
    """Called by the attention function: the announced layer, or ``None``."""
    layer = _PENDING.get()
    if layer is not None:
        _PENDING.set(None)
    return layer
