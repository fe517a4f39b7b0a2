"""Scores: how much each cache entry matters, per (batch row, KV head, position)."""

from criticalkv.scores.accumulated_attention import AccumulatedAttention
from criticalkv.scores.base import Scorer
from criticalkv.scores.defensive_aggregation import DefensiveAggregation
from criticalkv.scores.expected_attention import ExpectedAttention
from criticalkv.scores.key_diff import KeyDissimilarity
from criticalkv.scores.key_norm import KeyNorm
from criticalkv.scores.last_query import LastQueryAttention
from criticalkv.scores.positional import SinksAndRecent
from criticalkv.scores.value_norms import projected_value_norms
from criticalkv.scores.window_attention import WindowAttention

__all__ = [
    "AccumulatedAttention",
    "DefensiveAggregation",
    "ExpectedAttention",
    "KeyDissimilarity",
    "KeyNorm",
    "LastQueryAttention",
    "Scorer",
    "SinksAndRecent",
    "WindowAttention",
    "projected_value_norms",
]
