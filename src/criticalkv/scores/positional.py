"""StreamingLLM's attention sinks plus recent tokens (Xiao et al. 2023, arXiv 2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.scores.base import Scorer
from criticalkv.state import LayerState


@dataclass(frozen=True)
class SinksAndRecent(Scorer):
    """A positional score: the first ``sinks`` real tokens of each row first, then recency.

    With top-k selection a head keeps its observation window, the ``sinks`` initial tokens
    (the "attention sinks"; the earliest first if the budget holds fewer) and the most recent
    tokens before the window, as StreamingLLM's cache does. The score ignores queries, keys
    and values.

    Parameters
    ----------
    sinks : initial tokens always preferred (StreamingLLM uses 4).
    """

    sinks: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be a non-negative integer, not {self.sinks!r}")

    def __call__(self, state: LayerState) -> torch.Tensor:
        b, t = state.batch_size, state.seq_len
        column = torch.arange(t, device=state.keys.device, dtype=torch.float32)
        first_real = (t - state.lengths).to(column.device)  # rows are left-padded
        rank = column[None, :] - first_real[:, None]  # 0 at each row's first real token
        # sinks above everything, the first one highest; then the later the better
        scores = torch.where(rank < self.sinks, 3.0 * t - rank, column[None, :])
        return scores[:, None, :].expand(b, state.num_kv_heads, t)
