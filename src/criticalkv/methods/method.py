"""A compression method: the paper's Algorithm 2 template with one choice for each step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from criticalkv.budgets.base import Allocator, CrossLayerAllocator, HeadScoredAllocator
from criticalkv.budgets.uniform import Uniform
from criticalkv.needs import NOTHING, Needs
from criticalkv.scores.base import Scorer
from criticalkv.select.base import RankingSelector, Selector
from criticalkv.select.topk import TopK
from criticalkv.state import LayerState


@dataclass(frozen=True)
class Method:
    """A named KV-cache compression method: accumulate scores -> allocate budgets -> select per
    head (Feng et al. 2025, CriticalKV, Algorithm 2).

    ``scores`` is ``None`` for the full cache (nothing is evicted). What the method needs from
    the cache and the runtime is :attr:`needs`, merged from its three parts' declarations.
    """

    name: str
    description: str
    reference: str
    scores: Scorer | None
    budgets: Allocator = field(default_factory=Uniform)
    select: Selector = field(default_factory=TopK)

    def __post_init__(self) -> None:
        for label, part, kind in (
            ("scores", self.scores, Scorer),
            ("budgets", self.budgets, Allocator),
            ("select", self.select, Selector),
        ):
            if part is not None and not isinstance(part, kind):
                raise TypeError(
                    f"method {self.name!r}: {label} must be a criticalkv {kind.__module__}.{kind.__name__} subclass, "
                    f"not {type(part).__name__} (see docs/contributing.md)"
                )

    @property
    def compresses(self) -> bool:
        return self.scores is not None

    @property
    def needs(self) -> Needs:
        """What the method needs: its parts' declarations merged (nothing for the full cache)."""
        if self.scores is None:
            return NOTHING
        return self.scores.needs.merge(self.budgets.needs).merge(self.select.needs)

    @property
    def cross_layer(self) -> bool:
        """Whether the budgets are allocated over all layers jointly (the caches then defer)."""
        return self.needs.cross_layer

    @property
    def bound(self) -> bool:
        """Whether everything the method needs from a model is bound (its head scores)."""
        return not self.needs.head_scores or cast(HeadScoredAllocator, self.budgets).bound

    def options(self) -> dict[str, Any]:
        """The parameters of the method's parts, by name (what :meth:`with_options` can set)."""
        found: dict[str, Any] = {}
        for part in self._parts().values():
            for name, value in _parameters(part).items():
                found.setdefault(name, value)
        return found

    def _parts(self) -> dict[str, Any]:
        parts = {"scores": self.scores, "budgets": self.budgets, "select": self.select}
        return {label: part for label, part in parts.items() if part is not None}

    def with_options(self, **options: Any) -> Method:
        """The same method with parameters of its parts replaced, e.g. ``precision="exact"``.

        Each option goes to every part that has a parameter of that name (scores, budgets,
        selection); an option no part has is a ``ValueError`` listing the ones it has.
        """
        unknown = sorted(set(options) - set(self.options()))
        if unknown:
            have = ", ".join(sorted(self.options())) or "none"
            raise ValueError(f"method {self.name!r} has no option {', '.join(map(repr, unknown))}; its options: {have}")
        parts: dict[str, Any] = {}
        for label, part in self._parts().items():
            mine = {k: v for k, v in options.items() if k in _parameters(part)}
            if mine:
                parts[label] = dataclasses.replace(part, **mine)
        return dataclasses.replace(self, **parts)

    def with_norm_precision(self, precision: str | None) -> Method:
        """The method with the dtype of its ``||V W_O||`` products set (``"auto"``, ``"exact"``, ...),
        if it reads value norms (``needs.value_norms``); other methods, or ``None``, unchanged."""
        if precision is None or not self.needs.value_norms:
            return self
        return self.with_options(precision=precision)

    def keep_mask(self, state: LayerState, budget: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, T) bool mask of the entries to keep, given (B,) entries per head.

        The mask is on the layer's device (that of ``state.keys``), wherever ``budget`` was
        computed: a model sharded across devices compresses each layer where it lives.
        """
        if self.scores is None:
            return state.valid[:, None, :].expand(-1, state.num_kv_heads, -1).clone()
        budget = budget.to(state.keys.device)
        scores = self.ranked_scores(state, budget)
        budgets = self.budgets(scores, state, budget)
        return self.select(scores, budgets, state)

    def ranked_scores(self, state: LayerState, budget: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, T) what budgets and selection rank: the scores, ``-inf`` where an entry cannot
        be chosen, or the selection's own ranking of them if it ranks (``needs.ranks``, DefensiveKV)."""
        if self.scores is None:
            raise ValueError("the full cache ranks nothing")
        scores = self.scores(state).float().masked_fill(~state.eligible, float("-inf"))
        if not self.needs.ranks:
            return scores
        return cast(RankingSelector, self.select).rank(scores, state, budget)

    def keep_masks(self, states: Sequence[LayerState], budget: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, the (B, H_kv, T) keep mask, given (B,) entries per head; ``states`` are every
        layer of one prompt. Cross-layer budgets (``layer-defensivekv``) select over all of them
        jointly; the others compress each layer on its own, as :meth:`keep_mask` does."""
        if not self.needs.cross_layer:
            return [self.keep_mask(state, budget) for state in states]
        budget = budget.to(states[0].keys.device)
        ranked = [self.ranked_scores(state, budget.to(state.keys.device)) for state in states]
        per_layer = cast(CrossLayerAllocator, self.budgets).joint(ranked, states, budget)
        return [
            self.select(scores, budgets.to(state.keys.device), state)
            for scores, budgets, state in zip(ranked, per_layer, states, strict=True)
        ]


def _parameters(part: object) -> dict[str, Any]:
    """A dataclass part's constructor parameters and their values (none for other parts)."""
    if not dataclasses.is_dataclass(part) or isinstance(part, type):
        return {}
    values = vars(part)
    return {f.name: values[f.name] for f in dataclasses.fields(part) if f.init}
