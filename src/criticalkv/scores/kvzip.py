"""KVzip: the attention an entry receives while the model reconstructs the context (Kim et al. 2025,
"KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.needs import Needs
from criticalkv.scores.base import Scorer
from criticalkv.state import LayerState

#: appended queries whose attention is computed at once (bounds the (B, H_q, n, T) probabilities)
QUERY_BLOCK = 256


def reconstruction_attention(
    query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, context_len: int, scaling: float
) -> torch.Tensor:
    """(B, H_q, C) float32: per query head, the largest attention weight any appended query pays
    each of the first ``C = context_len`` keys.

    ``query`` (B, H_q, R, d) are the queries of ``R`` tokens appended after a context of ``C``
    cached tokens (after RoPE); ``keys`` (B, H_kv, C + R, d) the context's keys then theirs;
    ``valid`` (B, C + R) marks real tokens. Appended query ``i`` attends, with softmax
    ``softmax(s q k^T)`` (``s`` the scaling), to every real context key and to the real appended keys
    ``j <= i`` (causal), as the model's own forward does; padded queries are ignored. This is
    KVzip's ``max_i A[i, j]`` (Kim et al. 2025, eq. 2) before the maximum over a KV group.
    """
    b, h_q, r, d = query.shape
    h_kv, total = int(keys.shape[1]), int(keys.shape[2])
    if total != context_len + r or tuple(valid.shape) != (b, total):
        raise ValueError(
            f"keys ({total}) and valid {tuple(valid.shape)} must cover the context ({context_len}) then the {r} "
            "appended tokens"
        )
    g = h_q // h_kv
    k = keys.float()
    key_pos = torch.arange(total, device=keys.device)
    best = torch.zeros(b, h_kv, g, context_len, dtype=torch.float32, device=keys.device)
    for start in range(0, r, QUERY_BLOCK):
        q = query[:, :, start : start + QUERY_BLOCK].float()
        n = int(q.shape[2])
        logits = torch.einsum("bhgnd,bhtd->bhgnt", q.view(b, h_kv, g, n, d), k) * scaling
        q_pos = context_len + start + torch.arange(n, device=keys.device)
        allowed = valid[:, None, None, None, :] & (key_pos[None, :] <= q_pos[:, None])  # (B, 1, 1, n, T)
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        real_q = valid[:, context_len + start : context_len + start + n]
        probs = probs.masked_fill(~real_q[:, None, None, :, None], 0.0)
        best = torch.maximum(best, probs[..., :context_len].amax(dim=3))
    return best.view(b, h_q, context_len)


def require_reconstruction(state: LayerState, name: str) -> torch.Tensor:
    """``state.reconstruction``, or a clear error saying how to get it."""
    found = state.reconstruction
    if found is None:
        raise ValueError(
            f"{name} scores the attention paid while the model repeats the context, but this layer state has no "
            "reconstruction pass: compress with criticalkv.generate, or with criticalkv.runtime.prefill(..., "
            "reconstruction=criticalkv.runtime.repeat_prompt(tokenizer)) and CompressedCache.from_states"
        )
    if tuple(found.shape) != (state.batch_size, state.num_query_heads, state.seq_len):
        raise ValueError(
            f"the reconstruction attention has shape {tuple(found.shape)}, not (B, H_q, T) = "
            f"{(state.batch_size, state.num_query_heads, state.seq_len)}: it belongs to another prompt"
        )
    return found


@dataclass(frozen=True)
class ReconstructionAttention(Scorer):
    """KVzip's score: the most attention an entry receives from any query of a reconstruction pass,
    maximised over the query heads of its KV group (Kim et al. 2025, arXiv 2505.23416, eq. 2).

    Question-agnostic: after the context, the runtime teacher-forces a repeat prompt ("Repeat the
    previous context exactly." then the context again, see
    :func:`criticalkv.runtime.repeat_prompt`) on the full cache and records
    :func:`reconstruction_attention` per layer. The first ``sinks`` real tokens score 1 (no attention
    weight exceeds it), so they are kept first, as kvpress's ``KVzipPress`` does (``n_sink=4``).

    Parameters
    ----------
    sinks : initial real tokens always preferred.
    """

    sinks: int = 4
    #: read by the runtime: a reconstruction pass after the prefill; it cannot be redone while decoding
    needs: ClassVar[Needs] = Needs(reconstruction=True, prefill_only=True)

    def __post_init__(self) -> None:
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be a non-negative integer, not {self.sinks!r}")

    def __call__(self, state: LayerState) -> torch.Tensor:
        attention = require_reconstruction(state, "KVzip")
        b, t = state.batch_size, state.seq_len
        scores = attention.to(state.keys.device).view(b, state.num_kv_heads, state.group_size, t).amax(dim=2)
        positions = state.valid.long().cumsum(-1) - 1
        sink = state.valid & (positions < self.sinks)
        return scores.masked_fill(sink[:, None, :], 1.0)
