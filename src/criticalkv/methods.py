"""The registry of named compression methods: (scores, budgets, selection) triples.

A method is the paper's Algorithm 2 template (accumulate scores -> allocate budgets ->
select per head) with one choice for each step. CriticalKV is a selection step, so
``critical-adakv`` is AdaKV's scores and budgets with the two-stage critical selection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from criticalkv.budgets.adaptive import Adaptive
from criticalkv.budgets.base import Allocator
from criticalkv.budgets.head_prior import HeadPrior
from criticalkv.budgets.layer_joint import LayerJoint
from criticalkv.budgets.pyramid import Pyramid
from criticalkv.budgets.uniform import Uniform
from criticalkv.scores.accumulated_attention import AccumulatedAttention
from criticalkv.scores.base import Scorer
from criticalkv.scores.defensive_aggregation import DefensiveAggregation
from criticalkv.scores.key_norm import KeyNorm
from criticalkv.scores.positional import SinksAndRecent
from criticalkv.scores.window_attention import WindowAttention
from criticalkv.select.adaptive_critical import AdaptiveCritical
from criticalkv.select.base import Selector
from criticalkv.select.critical import Critical
from criticalkv.select.topk import TopK
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Method:
    """A named KV-cache compression method.

    ``scores`` is ``None`` for the full cache (nothing is evicted).
    """

    name: str
    description: str
    reference: str
    scores: Scorer | None
    budgets: Allocator = field(default_factory=Uniform)
    select: Selector = field(default_factory=TopK)

    @property
    def compresses(self) -> bool:
        return self.scores is not None

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

    @property
    def cross_layer(self) -> bool:
        """Whether the budgets are allocated over all layers jointly (the caches then defer)."""
        return self.scores is not None and bool(getattr(self.budgets, "cross_layer", False))

    def ranked_scores(self, state: LayerState, budget: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, T) what budgets and selection rank: the scores, ``-inf`` where an entry cannot
        be chosen, or the selection's own ranking of them if it defines ``rank`` (DefensiveKV)."""
        assert self.scores is not None
        scores = self.scores(state).float().masked_fill(~state.eligible, float("-inf"))
        rank = getattr(self.select, "rank", None)
        return scores if rank is None else rank(scores, state, budget)

    def keep_masks(self, states: Sequence[LayerState], budget: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, the (B, H_kv, T) keep mask, given (B,) entries per head; ``states`` are every
        layer of one prompt. Cross-layer budgets (``layer-defensivekv``) select over all of them
        jointly; the others compress each layer on its own, as :meth:`keep_mask` does."""
        if not self.cross_layer:
            return [self.keep_mask(state, budget) for state in states]
        budget = budget.to(states[0].keys.device)
        ranked = [self.ranked_scores(state, budget.to(state.keys.device)) for state in states]
        per_layer = self.budgets.joint(ranked, states, budget)  # type: ignore[attr-defined]
        return [
            self.select(scores, budgets.to(state.keys.device), state)
            for scores, budgets, state in zip(ranked, per_layer, states, strict=True)
        ]


_SNAPKV = "Li et al. 2024, SnapKV (arXiv 2404.14469)"
_ADAKV = "Feng et al. 2024, Ada-KV (arXiv 2407.11550)"
_CRITICAL = "Feng et al. 2025, CriticalKV (arXiv 2502.03805)"
_PYRAMIDKV = "Cai et al. 2024, PyramidKV (arXiv 2406.02069)"
_HEADKV = "Fu et al. 2024, HeadKV: Not All Heads Matter (arXiv 2410.19258)"
_STREAMINGLLM = "Xiao et al. 2023, StreamingLLM (arXiv 2309.17453)"
_H2O = "Zhang et al. 2023, H2O (arXiv 2306.14048)"
_KNORM = "Devoto et al. 2024, Knorm (arXiv 2406.11430)"
_DEFENSIVEKV = "Feng et al. 2025, DefensiveKV: Taming the Fragility of KV Cache Eviction (arXiv 2510.13334)"

_REGISTRY: dict[str, Callable[[], Method]] = {}


def register(name: str, factory: Callable[[], Method]) -> None:
    """Register a method factory under ``name`` (replacing any earlier one)."""
    _REGISTRY[name] = factory


def available_methods() -> list[str]:
    """Registered method names, in registration order."""
    return list(_REGISTRY)


def get_method(name: str | Method) -> Method:
    """The method registered as ``name`` (a :class:`Method` is returned as is)."""
    if isinstance(name, Method):
        return name
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]()


register(
    "full",
    lambda: Method("full", "No compression: every entry is kept (the reference).", "-", None),
)
register(
    "snapkv",
    lambda: Method("snapkv", "Window attention, uniform budgets, top-k per head.", _SNAPKV, WindowAttention()),
)
register(
    "adakv",
    lambda: Method(
        "adakv",
        "Window attention, adaptive cross-head budgets (safeguard 0.2), top-k per head.",
        _ADAKV,
        WindowAttention(),
        budgets=Adaptive(),
    ),
)
register(
    "critical-snapkv",
    lambda: Method(
        "critical-snapkv",
        "SnapKV scores and budgets; two-stage selection by attention x ||V W_O||_1.",
        _CRITICAL,
        WindowAttention(),
        select=Critical(),
    ),
)
register(
    "critical-adakv",
    lambda: Method(
        "critical-adakv",
        "AdaKV scores and budgets; two-stage selection by attention x ||V W_O||_1.",
        _CRITICAL,
        WindowAttention(),
        budgets=Adaptive(),
        select=Critical(),
    ),
)
register(
    "pyramidkv",
    lambda: Method(
        "pyramidkv",
        "Window attention, layer budgets decreasing linearly with depth (beta 20), top-k per head.",
        _PYRAMIDKV,
        WindowAttention(),
        budgets=Pyramid(),
    ),
)
register(
    "critical-pyramidkv",
    lambda: Method(
        "critical-pyramidkv",
        "PyramidKV scores and budgets; two-stage selection by attention x ||V W_O||_1.",
        _CRITICAL,
        WindowAttention(),
        budgets=Pyramid(),
        select=Critical(),
    ),
)
register(
    "headkv",
    lambda: Method(
        "headkv",
        "Window attention, per-head budgets from retrieval-reasoning head scores (beta 1.5), top-k per head.",
        _HEADKV,
        WindowAttention(),
        budgets=HeadPrior(),
    ),
)
register(
    "critical-headkv",
    lambda: Method(
        "critical-headkv",
        "HeadKV scores and budgets; two-stage selection by attention x ||V W_O||_1.",
        _CRITICAL,
        WindowAttention(),
        budgets=HeadPrior(),
        select=Critical(),
    ),
)
register(
    "streamingllm",
    lambda: Method(
        "streamingllm",
        "Attention sinks (the first 4 tokens) plus the most recent tokens, uniform budgets.",
        _STREAMINGLLM,
        SinksAndRecent(),
    ),
)
register(
    "h2o",
    lambda: Method(
        "h2o",
        "Attention accumulated over all prompt queries (heavy hitters) plus the window, uniform budgets.",
        _H2O,
        AccumulatedAttention(),
    ),
)
register(
    "knorm",
    lambda: Method(
        "knorm",
        "Keeps the keys with the lowest L2 norm (score -||k||), uniform budgets.",
        _KNORM,
        KeyNorm(),
    ),
)
register(
    "defensivekv",
    lambda: Method(
        "defensivekv",
        "Defensive aggregation (window max, floored at the head mean); adaptive stage 1 (90% of the attention "
        "mass), then attention x head-normalised ||V W_O||_1; budgets pooled over the layer's heads.",
        _DEFENSIVEKV,
        DefensiveAggregation(),
        budgets=Adaptive(alpha_floor=0.0),
        select=AdaptiveCritical(),
    ),
)
register(
    "layer-defensivekv",
    lambda: Method(
        "layer-defensivekv",
        "DefensiveKV with one selection over all layers and heads (same total budget; per-layer totals vary).",
        _DEFENSIVEKV,
        DefensiveAggregation(),
        budgets=LayerJoint(),
        select=AdaptiveCritical(),
    ),
)
