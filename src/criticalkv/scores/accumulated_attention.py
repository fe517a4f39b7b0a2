"""H2O's heavy hitters: attention accumulated over every prompt query (Zhang et al. 2023,
arXiv 2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.needs import ALL_QUERIES, Needs
from criticalkv.scores.base import Scorer
from criticalkv.scores.queries import require_all_queries
from criticalkv.state import LayerState


@dataclass(frozen=True)
class AccumulatedAttention(Scorer):
    """Attention each entry receives, summed over all prompt queries, GQA group mean.

    Every real prompt query is softmaxed over the keys it can see (causal, padding masked) in
    float32, and the weights are summed over the queries (H2O's accumulated attention score;
    with top-k selection and the always-kept observation window this is H2O's heavy hitters
    plus recent tokens, applied once to the prompt). The queries are processed in chunks so
    the (B, H_q, chunk, T) temporary stays below ``max_chunk_bytes``.

    Parameters
    ----------
    max_chunk_bytes : bound on the float32 logits temporary.
    """

    max_chunk_bytes: int = 1 << 25
    #: read by the caches: keep every prompt query in the layer state (so no decode-time re-selection,
    #: which holds only the last ``window`` decode queries)
    needs: ClassVar[Needs] = Needs(queries=ALL_QUERIES, prefill_only=True)

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_chunk_bytes, bool)
            or not isinstance(self.max_chunk_bytes, int)
            or self.max_chunk_bytes < 1
        ):
            raise ValueError(f"max_chunk_bytes must be positive, not {self.max_chunk_bytes}")

    def __call__(self, state: LayerState) -> torch.Tensor:
        require_all_queries(state, "H2O's accumulated attention")
        b, h_kv, t, d = state.keys.shape
        g = state.group_size
        queries = state.queries[:, :, -t:, :].reshape(b, h_kv, g, t, d)
        keys_t = state.keys.transpose(-1, -2)[:, :, None]  # (B, H_kv, 1, d, T)
        cols = torch.arange(t, device=state.keys.device)
        valid = state.valid
        total = torch.zeros(b, h_kv, g, t, dtype=torch.float32, device=state.keys.device)
        chunk = max(1, self.max_chunk_bytes // max(b * h_kv * g * t * 4, 1))
        for start in range(0, t, chunk):
            rows = cols[start : start + chunk]
            logits = torch.matmul(queries[:, :, :, start : start + chunk], keys_t).float() * state.scaling
            allowed = (cols[None, :] <= rows[:, None])[None] & valid[:, None, :]  # (B, c, T)
            logits = logits.masked_fill(~allowed[:, None, None], float("-inf"))
            weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a padding query sees no key
            weights = weights * valid[:, None, None, start : start + chunk, None]
            total += weights.sum(dim=3)
        return total.mean(dim=2)
