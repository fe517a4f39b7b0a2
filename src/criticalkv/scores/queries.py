"""How many prompt queries a scorer reads: the hand-off between scores and the caches.

The caches keep only the last ``window`` queries of the prompt in a :class:`LayerState` by
default (SnapKV-style scores need no more). A scorer that needs more declares it with a
``queries_needed`` attribute: ``None`` (the window), an ``int`` (that many last queries, at
least the window) or :data:`ALL_QUERIES` (every prompt query, e.g. H2O). :class:`CompressedCache`
and :class:`CaptureCache` honour it.
"""

from __future__ import annotations

from typing import Literal

from criticalkv.state import LayerState

#: sentinel for ``queries_needed``: every query of the prompt
ALL_QUERIES: Literal["all"] = "all"

QueriesNeeded = int | Literal["all"] | None


def queries_needed(scorer: object) -> QueriesNeeded:
    """The ``queries_needed`` a scorer declares (``None`` if it declares nothing)."""
    needed = getattr(scorer, "queries_needed", None)
    return check_queries_needed(needed)


def check_queries_needed(needed: object) -> QueriesNeeded:
    """Validate a ``queries_needed`` / ``num_queries`` value."""
    if needed is None or needed == ALL_QUERIES:
        return needed
    if isinstance(needed, bool) or not isinstance(needed, int) or needed < 1:
        raise ValueError(f"the number of queries must be a positive integer, 'all' or None, not {needed!r}")
    return needed


def resolve_num_queries(needed: QueriesNeeded, available: int) -> int | None:
    """The ``num_queries`` to keep from a prefill of ``available`` queries (``None``: the window)."""
    return available if needed == ALL_QUERIES else needed


def merge_queries_needed(first: QueriesNeeded, second: QueriesNeeded) -> QueriesNeeded:
    """The larger of two requirements (``'all'`` > any int > ``None``)."""
    if ALL_QUERIES in (first, second):
        return ALL_QUERIES
    if first is None or second is None:
        return second if first is None else first
    return max(int(first), int(second))


def require_all_queries(state: LayerState, name: str) -> None:
    """Raise a clear error if ``state`` lacks some of the prompt's queries."""
    held = int(state.queries.shape[2])
    if held < state.seq_len:
        raise ValueError(
            f"{name} scores every prompt query, but this layer state holds only the last {held} of "
            f"{state.seq_len}; capture the prefill with CaptureCache(..., num_queries='all') "
            "(or criticalkv.runtime.prefill(..., num_queries=input_ids.shape[1]))"
        )
