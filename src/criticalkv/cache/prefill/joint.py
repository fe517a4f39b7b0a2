"""Cross-layer budgets within a memory bound during the prefill: each layer holds only the entries
that can still win the joint selection.

:class:`~criticalkv.budgets.LayerJoint` keeps, per batch row, the ``K = L * H_kv * (b - w)``
highest scores outside the windows over all ``L`` layers (``b`` the budget per head, ``w`` the
window). Once layers ``1..l`` are seen, let ``tau_l`` be the K-th highest of their scores. An entry
scoring below ``tau_l`` has at least ``K`` entries strictly above it, and the later layers only add
entries, so it is never chosen: it is dropped at once. A head's selection (``Selector.top_ranked``:
its ``b_h - w`` highest scores) then never needs it either: all of a head's chosen entries score at
least the final ``tau_L >= tau_l``. Each layer's scores are computed on its full state as it is
prefilled and kept whole (one float per entry, against ``2 * d`` model-dtype numbers of keys and
values), so the per-layer budgets and every head's selection are those of the whole-prompt
selection (:meth:`~criticalkv.methods.Method.keep_masks`) exactly.

**The bound.** Between layers, the cache holds per row at most ``K`` entries of score ``>= tau``
(more only on exact ties at ``tau``) and every head's window: ``L * H_kv * b`` entries, the size of
the compressed cache, i.e. ``b / T`` of the full cache (0.2 of it at budget 0.2). On top, the layer
being prefilled holds its full keys and values (``1 / L`` of the full cache, as for every method),
and the final store rebuilds one layer at a time. So the KV held during the prompt is at most
``(b / T + 1 / L)`` x the full cache, plus ties; the candidates are held unquantized (the model's
dtype) until the selection, then stored as the cache's storage says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch

from criticalkv.budgets.base import CrossLayerAllocator
from criticalkv.cache.layer import CompressedLayer
from criticalkv.cache.storage import Storage
from criticalkv.cache.storage_table import new_storage
from criticalkv.methods import Method
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)

_LOWEST = torch.finfo(torch.float32).min


def bounded(method: Method) -> bool:
    """Whether ``method``'s cross-layer prefill can hold only its candidates (its selection keeps
    each head's top-ranked entries, ``Selector.top_ranked``); the others hold every layer whole."""
    return method.needs.cross_layer and method.select.top_ranked


@dataclass
class _Held:
    """One prefilled layer waiting for the joint selection."""

    layer: CompressedLayer
    meta: LayerState  # the layer's state without its keys and values (shapes, validity, window)
    scores: torch.Tensor  # (B, H_kv, T) what budgets and selection rank, -inf where ineligible
    keep: torch.Tensor  # (B, H_kv, T) bool, the entries held: candidates and the window
    storage: Storage  # the held entries' keys and values, per head in position order


def _without_kv(state: LayerState) -> LayerState:
    """``state`` with zero-size stand-ins for its keys and values (the same shapes, no memory)."""
    b, h, t, d = state.keys.shape
    blank = state.keys.new_zeros(1, 1, 1, 1).expand(b, h, t, d)
    queries = state.queries[:, :, -state.window :].clone()
    return LayerState(**{**state.__dict__, "keys": blank, "values": blank, "queries": queries, "memo": {}})


def _ranked(scores: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Scores as :func:`~criticalkv.select.topk.topk_mask` orders them: eligible ones finite, others -inf."""
    return scores.float().clamp(min=_LOWEST).masked_fill(~eligible, float("-inf"))


def _in_position_order(keep: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, width) the positions of each head's ``True`` entries of ``keep``, in order (then padding)."""
    return torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :width]


class JointPrefill:
    """Holds a cross-layer method's prefilled layers as candidates until the last one, then selects
    over all of them and stores each layer (see the module docstring for why nothing changes)."""

    def __init__(self, method: Method, num_layers: int) -> None:
        if not bounded(method):
            raise ValueError(
                f"method {method.name!r}: a bounded joint prefill needs cross-layer budgets and top-k selection"
            )
        self.method, self.num_layers = method, num_layers
        self.held: dict[int, _Held] = {}
        #: bytes the candidates occupy once the last layer added is held
        self.high_water = 0
        #: entries dropped so far (below the running threshold when their layer came, or later)
        self.dropped = 0
        #: once every layer is stored: each layer and its state without keys and values, in layer order
        self.stored: list[tuple[CompressedLayer, LayerState]] = []

    def held_bytes(self) -> int:
        """Bytes of keys and values the candidates occupy now."""
        return sum(h.storage.nbytes() for h in self.held.values())

    def add(self, layer: CompressedLayer, state: LayerState, budget: torch.Tensor) -> bool:
        """Take ``layer``'s prefill ``state`` at the (B,) budget per head; ``True`` once the last
        layer has come and every layer is stored."""
        budget = budget.to(state.keys.device)
        scores = self.method.ranked_scores(state, budget)
        tau = self._threshold(scores, state.eligible, budget, state.window)
        for other in self.held.values():  # first, so the layers together never hold more than K
            self._prune(other, tau.to(other.scores.device))
        keep = self._candidates(scores, state, tau)
        self.dropped += int((state.eligible & ~keep).sum())
        storage = new_storage(None)
        storage.set_prefix(state.keys, state.values, keep, reselected=False)
        self.held[layer.layer_idx] = _Held(layer, _without_kv(state), scores, keep, storage)
        self.high_water = self.held_bytes()
        if len(self.held) < self.num_layers:
            return False
        self._finish(budget)
        return True

    def _threshold(
        self, scores: torch.Tensor, eligible: torch.Tensor, budget: torch.Tensor, window: int
    ) -> torch.Tensor:
        """(B,) the K-th highest ranked score of the layers seen so far (``-inf``: fewer than K yet)."""
        device = scores.device
        parts = [_ranked(scores, eligible).flatten(1)]
        for h in self.held.values():
            parts.append(_ranked(h.scores, h.keep & h.meta.eligible).to(device).flatten(1))
        seen = torch.cat(parts, dim=1)
        k = (self.num_layers * scores.shape[1] * (budget.long() - window)).clamp(min=0)
        k_top = min(int(k.max()), seen.shape[1])
        if k_top == 0:
            return torch.full_like(budget, float("inf"), dtype=torch.float32)
        top = torch.topk(seen, k_top, dim=1, sorted=True).values
        at = (k.clamp(max=k_top) - 1).clamp(min=0)
        tau = top.gather(1, at[:, None])[:, 0]
        tau = torch.where(k > seen.shape[1], torch.full_like(tau, float("-inf")), tau)
        return torch.where(k == 0, torch.full_like(tau, float("inf")), tau)

    @staticmethod
    def _candidates(scores: torch.Tensor, state: LayerState, tau: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, T) bool: the window and the eligible entries scoring at least ``tau`` (per row)."""
        eligible = state.eligible
        above = _ranked(scores, eligible) >= tau[:, None, None]
        return (above & eligible) | (state.window_mask & state.valid[:, None, :])

    def _prune(self, held: _Held, tau: torch.Tensor) -> None:
        """Drop ``held``'s candidates that fell below ``tau`` (re-storing the rest), if any."""
        keep = self._candidates(held.scores, held.meta, tau) & held.keep
        if int(keep.sum()) == int(held.keep.sum()):
            return
        self.dropped += int(held.keep.sum()) - int(keep.sum())
        keys, values = self._dense(held)
        width = keys.shape[2]
        order = _in_position_order(held.keep, width)
        sub = keep.gather(2, order) & held.keep.gather(2, order)
        held.storage.set_prefix(keys, values, sub, reselected=False)
        held.keep = keep

    @staticmethod
    def _dense(held: _Held) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H_kv, W, d) the held entries of each head in position order (zero padding after)."""
        b, h = held.keep.shape[:2]
        keys, values = held.storage.dense_prefix()
        return keys.view(b, h, *keys.shape[1:]), values.view(b, h, *values.shape[1:])

    def _finish(self, budget: torch.Tensor) -> None:
        """Select over every held layer jointly and store each layer's kept entries."""
        order = sorted(self.held)
        allocator = cast(CrossLayerAllocator, self.method.budgets)
        metas = [self.held[i].meta for i in order]
        per_layer = allocator.joint([self.held[i].scores for i in order], metas, budget)
        for index, budgets in zip(order, per_layer, strict=True):
            held = self.held.pop(index)  # its candidates are freed once the layer is stored
            keep = self.method.select(held.scores, budgets.to(held.scores.device), held.meta)
            if bool((keep & ~held.keep).any()):
                raise RuntimeError(f"layer {held.layer.layer_idx}: the joint selection chose an entry that was dropped")
            keys, values = self._restore(held)
            held.layer.set_prefix(keys, values, keep)
            self.stored.append((held.layer, held.meta))
        logger.debug("%s: compressed %d layers jointly from their candidates", self.method.name, len(order))

    def _restore(self, held: _Held) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H_kv, T, d) keys and values with the held entries at their positions (zero elsewhere)."""
        keys, values = self._dense(held)
        b, h, t = held.keep.shape
        width, d = keys.shape[2], keys.shape[3]
        order = _in_position_order(held.keep, width)[..., None].expand(b, h, width, d)
        live = held.keep.gather(2, order[..., 0])[..., None]
        full_k = keys.new_zeros(b, h, t, d).scatter_(2, order, keys * live)
        full_v = values.new_zeros(b, h, t, d).scatter_(2, order, values * live)
        return full_k, full_v
