"""Scores: how much each cache entry matters, per (batch row, KV head, position)."""

from criticalkv.scores.base import Scorer
from criticalkv.scores.value_norms import projected_value_norms
from criticalkv.scores.window_attention import WindowAttention

__all__ = ["Scorer", "WindowAttention", "projected_value_norms"]
