"""Random :class:`LayerState` objects for the selection tests (no model needed)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from transformers import LlamaConfig

from criticalkv.scores.kvzip import reconstruction_attention
from criticalkv.state import LayerState


class StubAttention(nn.Module):
    """Just what compression reads off an attention module: ``o_proj``, ``scaling`` and ``config``."""

    def __init__(self, num_query_heads: int, head_dim: int, hidden: int, generator: torch.Generator) -> None:
        super().__init__()
        self.o_proj = nn.Linear(num_query_heads * head_dim, hidden, bias=False)
        with torch.no_grad():
            self.o_proj.weight.copy_(torch.randn(hidden, num_query_heads * head_dim, generator=generator))
        self.scaling = head_dim**-0.5
        # the RoPE parameters scores such as Expected Attention read (transformers 5 layout)
        self.config = LlamaConfig(
            hidden_size=num_query_heads * head_dim, num_attention_heads=num_query_heads, head_dim=head_dim
        )


def random_state(
    seed: int,
    *,
    lengths: Sequence[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    window: int,
    hidden: int = 12,
    seq_len: int | None = None,
    num_queries: int | None = None,
    zero_keys: bool = False,
    zero_values: bool = False,
) -> LayerState:
    """A left-padded layer state with random queries, keys and values.

    Row ``i`` holds ``lengths[i]`` real tokens at the end of ``seq_len`` (default: the
    longest row) columns. Padding keys and values are large, so that any leak of padding into
    the scores or the selection shows.
    """
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    t = max(lengths) if seq_len is None else seq_len
    n_q = window if num_queries is None else num_queries
    h_q = num_kv_heads * group
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, t - n :] = True
    queries = 2.0 * torch.randn(b, h_q, n_q, head_dim, generator=g)
    keys = torch.randn(b, num_kv_heads, t, head_dim, generator=g)
    values = torch.randn(b, num_kv_heads, t, head_dim, generator=g)
    pad = ~valid[:, None, :, None]
    keys = torch.where(pad, 50.0, keys)
    values = torch.where(pad, 1e3, values)
    if zero_keys:
        keys = torch.zeros_like(keys)
    if zero_values:
        values = torch.zeros_like(values)
    module = StubAttention(h_q, head_dim, hidden, g)
    return LayerState(
        queries=queries,
        keys=keys,
        values=values,
        valid=valid,
        module=module,
        window=window,
        layer_idx=0,
        num_layers=1,
    )


def to_device(state: LayerState, device: torch.device | str) -> LayerState:
    """``state`` with its tensors and (a copy of) its module on ``device``; ``state`` itself when
    it is there already. Random states are drawn on the CPU, so every device sees the same ones."""
    target = torch.device(device)
    if state.keys.device == target:
        return state
    moved = {name: getattr(state, name).to(target) for name in ("queries", "keys", "values", "valid")}
    module = copy.deepcopy(state.module).to(target)
    return LayerState(**{**state.__dict__, **moved, "module": module, "memo": {}})


def o_proj_weight(state: LayerState) -> torch.Tensor:
    weight = state.module.o_proj.weight
    assert isinstance(weight, torch.Tensor)
    return weight.detach()


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread: tiny tensors are much faster without the thread pool (and
    do not fight a busy machine for cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def with_all_queries(state: LayerState, seed: int = 0) -> LayerState:
    """``state`` with a random query for every prompt position before the ones it holds (for
    scores that read every prompt query, such as H2O's); the held queries stay as they are."""
    b, h_q, n_q, d = state.queries.shape
    missing = state.seq_len - n_q
    if missing <= 0:
        return state
    g = torch.Generator().manual_seed(seed)
    earlier = 2.0 * torch.randn(b, h_q, missing, d, generator=g)
    return LayerState(**{**state.__dict__, "queries": torch.cat([earlier, state.queries], dim=2)})


def with_reconstruction(state: LayerState) -> LayerState:
    """``state`` with a reconstruction pass's attention (KVzip): the held queries, as if appended after
    the prompt, attending to its keys and to copies of its last key (ties when the keys are)."""
    n_q = int(state.queries.shape[2])
    keys = torch.cat([state.keys, state.keys[:, :, -1:].expand(-1, -1, n_q, -1)], dim=2)
    appended = torch.ones(state.batch_size, n_q, dtype=torch.bool, device=state.valid.device)
    valid = torch.cat([state.valid, appended], dim=1)
    seen = reconstruction_attention(state.queries, keys, valid, state.seq_len, state.scaling)
    return LayerState(**{**state.__dict__, "memo": {}, "reconstruction": seen})
