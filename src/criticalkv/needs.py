"""What a method's parts need from the cache and the runtime, declared once.

Every score, budget and selection part declares a :class:`Needs` (a class attribute ``needs``);
:attr:`criticalkv.methods.Method.needs` merges its three parts' declarations and is the only
thing the caches, the runtime and the harnesses read to decide what to capture, when to select
and what to bind. Nothing probes a part for optional attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: ``Needs.queries`` value for "every query of the prompt" (H2O's accumulated attention)
ALL_QUERIES: Literal["all"] = "all"

#: prompt queries a part reads: ``None`` (the observation window), a count, or :data:`ALL_QUERIES`
QueriesNeeded = int | Literal["all"] | None


def check_queries_needed(needed: object) -> QueriesNeeded:
    """Validate a ``queries`` / ``num_queries`` value (``None``, a positive int or ``'all'``)."""
    if needed is None or needed == ALL_QUERIES:
        return needed
    if isinstance(needed, bool) or not isinstance(needed, int) or needed < 1:
        raise ValueError(f"the number of queries must be a positive integer, 'all' or None, not {needed!r}")
    return needed


def merge_queries_needed(first: QueriesNeeded, second: QueriesNeeded) -> QueriesNeeded:
    """The larger of two requirements (``'all'`` > any int > ``None``)."""
    if ALL_QUERIES in (first, second):
        return ALL_QUERIES
    if first is None or second is None:
        return second if first is None else first
    return max(int(first), int(second))


@dataclass(frozen=True)
class Needs:
    """The requirements of a method part (or, merged, of a whole method).

    Attributes
    ----------
    queries : prompt queries the scores read beyond the window (``None``: the window only; an int:
        that many last queries; ``'all'``: every prompt query). The caches keep that many.
    cross_layer : the budgets are allocated over all layers jointly (a
        :class:`~criticalkv.budgets.CrossLayerAllocator`): the cache defers selection until
        every layer's prefill state is known.
    head_scores : the budgets use per-head importance scores (a
        :class:`~criticalkv.budgets.HeadScoredAllocator`), bound to a model by
        :meth:`~criticalkv.methods.Method.bind` before a cache exists.
    ranks : the selection ranks entries itself (a :class:`~criticalkv.select.RankingSelector`):
        budgets are allocated on its ranking instead of the raw scores (DefensiveKV).
    value_norms : the selection reads ``||V W_O||`` (the attention module's output projection);
        its ``precision`` option sets the dtype of that product.
    prefill_only : the part can only score a prompt's prefill state, not a cache re-selected while
        decoding (decode-time compression keeps the last ``window`` queries of the decode steps
        and compresses one layer at a time): e.g. scores over every prompt query (H2O) or over the
        prompt's reconstruction (KVzip). A decode budget with such a method is refused up front.
        (Budgets over all layers jointly are not: each layer is re-selected to its share of the
        decode budget, frozen from the prompt's joint selection.)
    reconstruction : the scores read the attention each prompt entry receives while the model
        repeats the prompt (KVzip's context reconstruction): the runtime teacher-forces a repeat
        prompt after the prompt on the full cache (:func:`criticalkv.runtime.reconstruct`) and
        hands each layer's result in :attr:`LayerState.reconstruction`. A cache that compresses
        during ``model.generate``'s own prefill cannot run that pass and refuses such a method.
    """

    queries: QueriesNeeded = None
    cross_layer: bool = False
    head_scores: bool = False
    ranks: bool = False
    value_norms: bool = False
    prefill_only: bool = False
    reconstruction: bool = False

    def __post_init__(self) -> None:
        check_queries_needed(self.queries)

    def merge(self, other: Needs) -> Needs:
        """What two parts need together."""
        return Needs(
            queries=merge_queries_needed(self.queries, other.queries),
            cross_layer=self.cross_layer or other.cross_layer,
            head_scores=self.head_scores or other.head_scores,
            ranks=self.ranks or other.ranks,
            value_norms=self.value_norms or other.value_norms,
            prefill_only=self.prefill_only or other.prefill_only,
            reconstruction=self.reconstruction or other.reconstruction,
        )


#: the declaration of a part that needs nothing beyond the window's queries
NOTHING = Needs()
