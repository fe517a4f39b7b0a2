"""How many prompt queries a method reads: the hand-off between its declared needs and the caches.

The caches keep only the last ``window`` queries of the prompt in a :class:`LayerState` by
default (SnapKV-style scores need no more). A scorer that needs more declares it in its
:class:`~criticalkv.needs.Needs` (``queries``): ``None`` (the window), an ``int`` (that many last
queries, at least the window) or :data:`ALL_QUERIES` (every prompt query, e.g. H2O).
:class:`CompressedCache` and :class:`CaptureCache` honour it.
"""

from __future__ import annotations

from criticalkv.needs import ALL_QUERIES, QueriesNeeded
from criticalkv.state import LayerState

__all__ = ["require_all_queries", "resolve_num_queries"]


def resolve_num_queries(needed: QueriesNeeded, available: int) -> int | None:
    """The ``num_queries`` to keep from a prefill of ``available`` queries (``None``: the window)."""
    return available if needed == ALL_QUERIES else needed


def require_all_queries(state: LayerState, name: str) -> None:
    """Raise a clear error if ``state`` lacks some of the prompt's queries."""
    held = int(state.queries.shape[2])
    if held < state.seq_len:
        raise ValueError(
            f"{name} scores every prompt query, but this layer state holds only the last {held} of "
            f"{state.seq_len}; capture the prefill with CaptureCache(..., num_queries='all') "
            "(or criticalkv.runtime.prefill(..., num_queries=input_ids.shape[1]))"
        )
