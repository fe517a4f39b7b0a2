"""Computing what the configs of one prefill share once per layer: scores and value norms.

The experiment compresses one prefill with up to tens of (method, budget) configs. Methods with
equal scorers (every window-attention method here) score each layer identically, and every
Critical variant needs the same ``||V W_O||`` norms of a layer; both are memoised for the
duration of one sample. Selection is unchanged: the memo returns exactly what the scorer and
:meth:`criticalkv.select.Critical.norms` compute.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from criticalkv.methods import Method
from criticalkv.scores.queries import queries_needed
from criticalkv.select.critical import Critical
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)

Memo = dict[tuple[Any, ...], torch.Tensor]


def _state_key(state: LayerState) -> tuple[int, int, int, int]:
    return state.layer_idx, id(state.keys), id(state.values), id(state.queries)


class _SharedScores:
    """A scorer whose output is looked up in ``memo`` by (layer state, scorer)."""

    def __init__(self, inner: Any, memo: Memo) -> None:
        self.inner = inner
        self.memo = memo

    @property
    def queries_needed(self) -> Any:
        return queries_needed(self.inner)

    def __call__(self, state: LayerState) -> torch.Tensor:
        key = ("scores", *_state_key(state), self.inner)
        if key not in self.memo:
            self.memo[key] = self.inner(state)
        return self.memo[key].clone()


@dataclass(frozen=True)
class _SharedNormsCritical(Critical):
    """:class:`Critical` whose value norms are looked up in ``memo`` by (layer state, p)."""

    memo: Memo = field(default_factory=dict, compare=False, repr=False)

    def norms(self, state: LayerState) -> torch.Tensor:
        key = ("norms", *_state_key(state), self.p)
        if key not in self.memo:
            self.memo[key] = super().norms(state)
        return self.memo[key]


def _hashable(value: object) -> bool:
    if not isinstance(value, Hashable):
        return False
    try:
        hash(value)
    except TypeError:
        return False
    return True


def share_across_configs(method: Method, memo: Memo) -> Method:
    """``method`` with its scores and Critical norms read from ``memo`` (filled on first use).

    Only hashable scorers (frozen dataclasses, so equal scorers share) and an exact
    :class:`Critical` selection (not a subclass, which may compute norms its own way) are
    shared; anything else is left as it is. The memo must not outlive the layer states it was
    filled from (entries are keyed by tensor identity).
    """
    changes: dict[str, Any] = {}
    if method.scores is not None and _hashable(method.scores):
        changes["scores"] = _SharedScores(method.scores, memo)
    select = method.select
    if type(select) is Critical and callable(getattr(Critical, "norms", None)):
        params = {f.name: getattr(select, f.name) for f in dataclasses.fields(select)}
        changes["select"] = _SharedNormsCritical(**params, memo=memo)
    return dataclasses.replace(method, **changes) if changes else method
