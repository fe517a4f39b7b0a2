"""Expected Attention: the attention future queries are expected to pay, from the statistics of the
prompt's queries (Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating
Attention from Future Queries Distribution", arXiv 2510.00636; kvpress's ``ExpectedAttentionPress``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.needs import ALL_QUERIES, Needs
from criticalkv.scores.base import Scorer
from criticalkv.scores.queries import require_all_queries
from criticalkv.scores.rope import mean_rotation, rope_frequencies, unrotate
from criticalkv.state import LayerState


@dataclass(frozen=True)
class ExpectedAttention(Scorer):
    """Softmax of ``E[q . k_i] * s + s^2 k_i^T Sigma k_i / 2`` over the keys, GQA group mean.

    Question-agnostic: no query of a question is needed. Per query head, the prompt's queries
    (every real one after the first ``sinks``, RoPE undone) give a mean ``mu`` and a covariance
    ``Sigma``; both are rotated by the RoPE matrix averaged over the next ``future`` positions (the
    queries still to come). For a Gaussian query, ``log E[exp(s q.k)] = s mu.k + s^2 k^T Sigma k / 2``
    (``s``: the attention scaling); its softmax over the row's real non-sink keys is the expected
    attention. Heads of a KV group are averaged; with ``value_norm`` the score is then
    ``(score + eps) * ||v_i||_2``. The first ``sinks`` real tokens score their head's maximum, so
    they are kept first (kvpress does the same).

    Where this differs from kvpress 0.5: the query statistics come from the model's actual queries
    (kvpress recomputes them from the hidden states with ``q_proj``, which gives the same queries,
    query bias included: tests/bench/test_kvpress_agreement.py), padding is excluded per row, and the
    sinks get their head's maximum rather than the batch's.

    Parameters
    ----------
    future : number of future positions the RoPE rotation is averaged over (512 in kvpress).
    sinks : initial tokens left out of the statistics and always preferred (4 in kvpress).
    covariance : include the covariance term (kvpress's ``use_covariance``).
    value_norm : rescale by ``||v||_2`` (kvpress's ``use_vnorm``); the Critical variant turns it off,
        its selection weighing by ``||v W_O||`` instead.
    eps : added before the value-norm rescaling (kvpress's ``epsilon``).
    """

    future: int = 512
    sinks: int = 4
    covariance: bool = True
    value_norm: bool = True
    eps: float = 0.0
    #: read by the caches: the statistics are over every prompt query
    needs: ClassVar[Needs] = Needs(queries=ALL_QUERIES, prefill_only=True)

    def __post_init__(self) -> None:
        for name in ("future", "sinks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "future" else 0):
                raise ValueError(
                    f"{name} must be a {'positive' if name == 'future' else 'non-negative'} integer, not {value!r}"
                )
        if self.eps < 0:
            raise ValueError(f"eps must be >= 0, not {self.eps}")

    def __call__(self, state: LayerState) -> torch.Tensor:
        key = ("expected_attention", self.future, self.sinks, self.covariance, self.value_norm, self.eps)
        return state.remember(key, lambda: self._scores(state))

    def statistics(self, state: LayerState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, H_q, d) mean and (B, H_q, d, d) covariance of the future queries (``None`` without
        ``covariance``), RoPE for the next ``future`` positions applied."""
        require_all_queries(state, "Expected Attention")
        t, d = state.seq_len, state.head_dim
        device = state.keys.device
        inv_freq, scale = rope_frequencies(state.module, d, device)
        positions = (state.valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, T), as generate assigns them
        queries = unrotate(state.queries[:, :, -t:, :].float(), positions[:, None, :], inv_freq, scale)
        used = (state.valid & (positions >= self.sinks)).float()[:, None, :, None]  # (B, 1, T, 1)
        count = used.sum(dim=2, keepdim=True).clamp_min(1.0)
        mean = (queries * used).sum(dim=2, keepdim=True) / count  # (B, H_q, 1, d)
        rotation = mean_rotation(state.lengths.to(device), self.future, inv_freq, scale)[:, None]  # (B, 1, d, d)
        mu = (mean @ rotation.transpose(-1, -2))[:, :, 0]
        if not self.covariance:
            return mu, None
        centred = (queries - mean) * used
        cov = centred.transpose(-1, -2) @ centred / count  # (B, H_q, d, d), population covariance
        return mu, rotation @ cov @ rotation.transpose(-1, -2)

    def _scores(self, state: LayerState) -> torch.Tensor:
        b, h_kv, _, d = state.keys.shape
        g = state.group_size
        mu, cov = self.statistics(state)
        keys = state.keys.float()[:, :, None]  # (B, H_kv, 1, T, d)
        s = state.scaling
        logits = (keys @ mu.view(b, h_kv, g, d, 1))[..., 0] * s  # (B, H_kv, G, T)
        if cov is not None:
            quadratic = ((keys @ cov.view(b, h_kv, g, d, d)) * keys).sum(-1)
            logits = logits + quadratic * (s * s / 2)
        positions = (state.valid.long().cumsum(-1) - 1).clamp(min=0)
        sink = state.valid & (positions < self.sinks)
        logits = logits.masked_fill(~(state.valid & ~sink)[:, None, None, :], float("-inf"))
        scores = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=2)  # (B, H_kv, T)
        if self.value_norm:
            scores = (scores + self.eps) * torch.linalg.vector_norm(state.values.float(), dim=-1)
        top = scores.masked_fill(~state.valid[:, None, :], float("-inf")).amax(dim=-1, keepdim=True)
        return torch.where(sink[:, None, :], top.expand_as(scores), scores)
