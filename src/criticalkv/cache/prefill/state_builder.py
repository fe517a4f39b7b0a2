"""The layer state a prefill hands to a method, the observation window's check, and device synchronisation."""

from __future__ import annotations

import torch
from torch import nn

from criticalkv.options import OptionError
from criticalkv.state import LayerState

DEFAULT_WINDOW = 32


def check_window(window: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise OptionError("<window> must be a positive integer number of tokens, not {window!r}", window=window)
    return window


def state_from_prefill(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    module: nn.Module,
    *,
    window: int,
    layer_idx: int,
    num_layers: int,
    num_queries: int | None = None,
) -> LayerState:
    """Build a :class:`LayerState` from the tensors the attention function sees in the prefill.

    It holds the last ``max(window, num_queries)`` queries (all of them at most).
    """
    lengths = valid.sum(-1)
    shortest = int(lengths.min())
    if shortest < window:
        raise ValueError(
            f"a prompt of {shortest} tokens is shorter than the observation window ({window} tokens); "
            "use a longer context or a smaller window"
        )
    n_q = window if num_queries is None else max(window, num_queries)
    n_q = min(n_q, query.shape[2])
    return LayerState(
        queries=query[:, :, -n_q:, :],
        keys=keys,
        values=values,
        valid=valid,
        module=module,
        window=window,
        layer_idx=layer_idx,
        num_layers=num_layers,
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
