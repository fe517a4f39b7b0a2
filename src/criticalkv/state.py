"""What one decoder layer exposes to compression after the prefill."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class LayerState:
    """The prefill state of one attention layer, as seen by scores, budgets and selection.

    Rows are left-padded: column ``T - 1`` is the last prompt token of every row, and the
    observation window is the last ``window`` columns (always real tokens).

    Attributes
    ----------
    queries : (B, H_q, n_q, d) the last ``n_q >= window`` queries of the prompt, after RoPE.
    keys, values : (B, H_kv, T, d) the layer's full keys (after RoPE) and values.
    valid : (B, T) bool, ``False`` on padding.
    module : the attention module (gives ``o_proj`` and ``scaling``).
    window : size of the observation window; its entries are always kept.
    layer_idx, num_layers : position of the layer in the model.
    memo : derived tensors (value norms, window attention) computed once per state and reused
        when one prefill is compressed many ways; keys name everything they depend on.
    present : (B, H_kv, T) bool, or ``None`` (every valid entry). A state rebuilt from an already
        compressed cache (decode-time compression) lines up the positions any head of a row still
        holds; ``present`` says which of them each KV head holds. Scores mask the others like padding.
    reconstruction : (B, H_q, T) float32, or ``None``: per query head, the most attention each entry
        received from the queries of a context-reconstruction pass (KVzip; set by
        :func:`criticalkv.runtime.reconstruct` for methods whose ``needs.reconstruction`` is set).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    module: nn.Module
    window: int
    layer_idx: int
    num_layers: int
    memo: dict[Any, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    present: torch.Tensor | None = field(default=None, compare=False, repr=False)
    reconstruction: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def remember(self, key: Any, compute: Any) -> torch.Tensor:
        """``memo[key]``, computed by ``compute()`` the first time."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    @property
    def batch_size(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[1])

    @property
    def num_query_heads(self) -> int:
        return int(self.queries.shape[1])

    @property
    def group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    @property
    def seq_len(self) -> int:
        return int(self.keys.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.keys.shape[3])

    @property
    def scaling(self) -> float:
        return float(getattr(self.module, "scaling", self.head_dim**-0.5))

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) number of real (non-padding) tokens per row."""
        return self.valid.sum(-1)

    @property
    def held(self) -> torch.Tensor:
        """(B, 1, T) bool, or (B, H_kv, T) with ``present``: the entries a head holds (real tokens)."""
        real = self.valid[:, None, :]
        return real if self.present is None else real & self.present

    @property
    def window_mask(self) -> torch.Tensor:
        """(B, 1, T) bool, ``True`` on the observation window (the last ``window`` columns)."""
        mask = torch.zeros(self.batch_size, 1, self.seq_len, dtype=torch.bool, device=self.keys.device)
        mask[..., self.seq_len - self.window :] = True
        return mask

    @property
    def eligible(self) -> torch.Tensor:
        """(B, H_kv, T) bool: entries a selection may choose (real tokens outside the window)."""
        mask = self.held & ~self.window_mask
        return mask.expand(-1, self.num_kv_heads, -1)
