"""Decode-time compression: a :class:`CompressedCache` held at a budget while it decodes.

When a layer holds more than ``budget + interval`` entries per KV head on average (kept prompt
entries plus the generated tail), it is re-selected back to ``budget`` per head on average by the
method's own scores, budget rule and selection, the last ``window`` queries of the decode steps
acting as the observation window (:mod:`criticalkv.cache.decode.reselect`). Memory then stays bounded
however long the output, and each re-selection costs about what one prefill selection of
``budget + interval`` entries costs, once every ``interval`` steps. The selections stay the same
code as for the prompt: this is a layer on the cache (when it re-selects), not a special case.

Bookkeeping per layer: the last ``window`` queries; with a selection that reads value norms
(CriticalKV, DefensiveKV), ``||V W_O||`` of every held entry, computed once per entry (the prompt's
in the prefill; an appended entry's at the first re-selection it takes part in, for the whole
tail in one product) and kept beside it, never recomputed; the held count per row, tracked on the
host so a step that does not re-select costs no device synchronisation.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from criticalkv.cache.decode.reselect import kept_in_order, reselect, tail_entries
from criticalkv.cache.decode.shares import joint_shares
from criticalkv.cache.layer import CompressedLayer
from criticalkv.defaults import DEFAULT_INTERVAL as DEFAULT_INTERVAL
from criticalkv.methods import Method
from criticalkv.options import OptionError, OptionTypeError
from criticalkv.scores.value_norms import norm_dtype, norms_memo_key, projected_value_norms
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)


def check_decode_budget(method: Method, window: int, budget: object, interval: object) -> tuple[int, int]:
    """Validate a decode budget and interval for ``method`` (before any work); returns them."""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise OptionTypeError(
            "<decode_budget> must be a token count per KV head (an int), not {budget!r}", budget=budget
        )
    if budget < window:
        raise OptionError(
            "<decode_budget> {budget} is below the observation window ({window} tokens), which is always "
            "kept; pass a decode budget of at least {window} or lower the <window>",
            budget=budget,
            window=window,
        )
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise OptionError(
            "<decode_interval> must be a positive number of tokens (re-select after that many new entries "
            "per head), not {interval!r}; e.g. 64",
            interval=interval,
        )
    if not method.compresses:
        raise OptionError(
            "method {name!r} keeps every entry, so it cannot hold a decode budget; pick a compressing "
            "<method> (e.g. critical-adakv), or drop the <decode_budget>",
            name=method.name,
        )
    if method.needs.prefill_only:
        why = (
            "its scores read the prompt's reconstruction"
            if method.needs.reconstruction
            else "its scores read every prompt query"
        )
        raise OptionError(
            "method {name!r} cannot re-select while decoding ({why}; decode-time compression keeps "
            "only the last window of queries); use it without a "
            "<decode_budget>, or pick another <method> (e.g. snapkv, critical-adakv, defensivekv)",
            name=method.name,
            why=why,
        )
    return budget, interval


@dataclass
class LayerDecode:
    """What one layer keeps between re-selections (per batch row where a list)."""

    module: Any
    queries: torch.Tensor  # (B, H_q, window, d) the most recent queries
    prompt_width: int  # padded prompt length (logical positions before the first appended token)
    prefix_norms: torch.Tensor | None  # (S, L) value norms of the prefix entries, segment order
    prefix_avg: list[float]  # prefix entries per KV head on average
    budget: list[int]  # entries per KV head on average a re-selection brings the layer back to
    threshold: list[float]  # re-select once the held average exceeds this
    tail_valid: list[torch.Tensor] = field(default_factory=list)  # each (B, q) bool
    tail_counts: list[int] = field(default_factory=list)  # real tail entries per row


class DecodeCompression:
    """The decode budget of one cache: hooks its layers call after the prefill and after each attention.

    Parameters
    ----------
    method : the cache's (bound) method; checked by :func:`check_decode_budget`.
    budget : entries per KV head on average a layer is brought back to.
    interval : entries per head a layer may grow by before it is re-selected.
    window : the observation window (the last ``window`` queries score the re-selection).
    num_layers : layers of the model.
    """

    def __init__(self, method: Method, budget: int, interval: int, window: int, num_layers: int) -> None:
        self.budget, self.interval = check_decode_budget(method, window, budget, interval)
        self.method, self.window, self.num_layers = method, window, num_layers
        options = method.options() if method.needs.value_norms else {}
        self.norm_p: int | None = int(options.get("p", 1)) if method.needs.value_norms else None
        self.norm_precision = str(options.get("precision", "auto"))
        self.layers: dict[int, LayerDecode] = {}
        #: re-selections done (all layers) and the seconds they took
        self.reselections = 0
        self.seconds = 0.0
        self._bytes: dict[int, int] = {}  # each layer's bytes as last seen
        self._total = 0
        #: the most the layers held together at any point (before each re-selection included)
        self.peak_bytes = 0

    def install(self, layers: list[CompressedLayer]) -> None:
        for layer in layers:
            layer.on_attend = self.after_attend

    # --- hooks -----------------------------------------------------------------------------------
    def after_prefill(self, layer: CompressedLayer, state: LayerState) -> None:
        """Start tracking ``layer`` once its prompt is compressed (``layer.keep`` set from ``state``)."""
        assert layer.holds_prompt and layer.keep is not None
        norms = None
        if self.norm_p is not None:
            norms = kept_in_order(self._state_norms(state), layer.keep, layer)
        self._track(layer, state, norms, [self.budget] * layer.batch_size)

    def after_joint_prefill(self, layers: Sequence[tuple[CompressedLayer, LayerState]]) -> None:
        """Start tracking every layer once a cross-layer selection has stored them all: each layer's
        budget is its share of ``L * budget`` from the prompt's selection (:mod:`.shares`).

        The states may lack keys and values (a bounded joint prefill holds only their shapes), so the
        value norms are those of the stored entries."""
        held = torch.stack([layer.prefix_lengths().double().mean(-1) for layer, _ in layers])
        shares = joint_shares(held, self.budget, self.window)
        logger.debug("decode shares per layer (row 0): %s", shares[:, 0].tolist())
        for (layer, state), share in zip(layers, shares, strict=True):
            norms = None
            if self.norm_p is not None:
                values = layer.storage.dense_prefix()[1]
                per_head = values.view(layer.batch_size, layer.num_kv_heads, *values.shape[1:])
                norms = self._norms(per_head, state.module).flatten(0, 1)
            self._track(layer, state, norms, share.tolist())

    def _track(self, layer: CompressedLayer, state: LayerState, norms: torch.Tensor | None, budget: list[int]) -> None:
        self.layers[layer.layer_idx] = LayerDecode(
            module=state.module,
            queries=state.queries[:, :, -self.window :].clone(),  # frees the prefill's query tensor
            prompt_width=state.seq_len,
            prefix_norms=norms,
            prefix_avg=layer.prefix_lengths().double().mean(-1).tolist(),
            budget=budget,
            threshold=[float(b + self.interval) for b in budget],
            tail_counts=[0] * layer.batch_size,
        )
        self._limit_tail(layer, self.layers[layer.layer_idx])
        self._account(layer)

    def after_attend(
        self,
        layer: CompressedLayer,
        query: torch.Tensor,
        values: torch.Tensor,
        attention_mask: torch.Tensor | None,
        module: Any,
    ) -> None:
        """Note the step's queries and new entries; re-select the layer if it outgrew its budget."""
        track = self.layers.get(layer.layer_idx)
        if track is None:
            return
        b, q = query.shape[0], query.shape[2]
        if b != len(track.tail_counts):
            raise RuntimeError(
                "decode-time compression holds per-row state and does not follow batch reordering "
                "(beam search, num_return_sequences); generate without a decode budget for those"
            )
        valid = self._new_valid(layer, attention_mask, q)
        track.queries = _last_real(track.queries, query, valid, self.window)
        track.tail_valid.append(torch.ones(b, q, dtype=torch.bool, device=query.device) if valid is None else valid)
        counts = [q] * b if valid is None else valid.sum(-1).tolist()
        track.tail_counts = [c + n for c, n in zip(track.tail_counts, counts, strict=True)]
        self._account(layer)
        over = any(a + c > t for a, c, t in zip(track.prefix_avg, track.tail_counts, track.threshold, strict=True))
        if over:
            self._reselect(layer, track)

    # --- re-selection ----------------------------------------------------------------------------
    def _reselect(self, layer: CompressedLayer, track: LayerDecode) -> None:
        started = time.perf_counter()
        norms = None
        if track.prefix_norms is not None:  # the tail's norms, each entry's computed now and only now
            tail_values = tail_entries(layer)[1].view(layer.batch_size, layer.num_kv_heads, -1, layer.head_dim)
            tail_norms = self._norms(tail_values, track.module).flatten(0, 1)
            norms = torch.cat([track.prefix_norms, tail_norms], dim=1)
        result = reselect(
            layer,
            self.method,
            torch.tensor(track.budget, device=track.queries.device),
            queries=track.queries,
            tail_valid=torch.cat(track.tail_valid, dim=1),
            module=track.module,
            window=self.window,
            num_layers=self.num_layers,
            norms=norms,
            norms_key=self._norms_key(layer),
        )
        track.prefix_norms = result.norms
        track.prefix_avg = layer.prefix_lengths().double().mean(-1).tolist()
        # each layer is held to what the budget rule gave it (layer-varying rules: its own share)
        track.threshold = [a + self.interval for a in track.prefix_avg]
        track.tail_valid = []
        track.tail_counts = [0] * layer.batch_size
        self._limit_tail(layer, track)
        self.reselections += 1
        self.seconds += time.perf_counter() - started
        self._account(layer)

    @staticmethod
    def _limit_tail(layer: CompressedLayer, track: LayerDecode) -> None:
        """Size the layer's tail for the most single-token steps before its next re-selection: the
        first row to exceed its threshold re-selects the layer, so memory held is memory needed."""
        room = min(t - a for a, t in zip(track.prefix_avg, track.threshold, strict=True))
        layer.limit_tail(max(1, math.floor(room) + 1))

    def _new_valid(self, layer: CompressedLayer, attention_mask: torch.Tensor | None, q: int) -> torch.Tensor | None:
        """(B, q) bool of the appended entries that are real tokens, ``None`` when all are (no sync)."""
        if q == 1 or attention_mask is None:
            return None  # a single decode token is always real; no mask: no padding
        end = layer.prefix_len + layer.tail_len
        cols = attention_mask[:, 0, -1, end - q : end]  # the last query (a real token) sees every real entry
        return cols if cols.dtype == torch.bool else cols == 0

    def _norms_key(self, layer: CompressedLayer) -> Any:
        if self.norm_p is None:
            return None
        probe = torch.empty(0, dtype=layer.dtype, device=layer.device)
        return norms_memo_key(self.norm_p, norm_dtype(self.norm_precision, probe))

    def _norms(self, values: torch.Tensor, module: Any) -> torch.Tensor:
        assert self.norm_p is not None
        dtype = norm_dtype(self.norm_precision, values)
        weight = module.o_proj.weight
        return projected_value_norms(values, weight, p=self.norm_p, precision=str(dtype).removeprefix("torch."))

    def _state_norms(self, state: LayerState) -> torch.Tensor:
        """The prompt's norms, shared with the prefill selection when it computed them."""
        assert self.norm_p is not None
        key = norms_memo_key(self.norm_p, norm_dtype(self.norm_precision, state.values))
        return state.remember(key, lambda: self._norms(state.values, state.module))

    # --- accounting and copies -------------------------------------------------------------------
    def _account(self, layer: CompressedLayer) -> None:
        now = layer.nbytes()
        self._total += now - self._bytes.get(layer.layer_idx, 0)
        self._bytes[layer.layer_idx] = now
        self.peak_bytes = max(self.peak_bytes, self._total)

    def appended(self, layer: CompressedLayer) -> int:
        """Tokens appended to ``layer`` since its prompt (the generated tokens, padding included)."""
        track = self.layers.get(layer.layer_idx)
        return layer.tail_len if track is None else layer.get_seq_length() - track.prompt_width

    def fork(self) -> DecodeCompression:
        """An independent copy for a forked cache (the fork starts with an empty tail)."""
        clone = DecodeCompression(self.method, self.budget, self.interval, self.window, self.num_layers)
        for idx, track in self.layers.items():
            # tensors are replaced, never written in place, so sharing them is safe
            clone.layers[idx] = replace(track, tail_valid=[], tail_counts=[0] * len(track.tail_counts))
        clone._bytes, clone._total = dict(self._bytes), self._total
        return clone


def _last_real(buffer: torch.Tensor, new: torch.Tensor, valid: torch.Tensor | None, window: int) -> torch.Tensor:
    """The last ``window`` real queries of each row: ``buffer`` (B, H_q, window, d) then ``new``."""
    both = torch.cat([buffer, new], dim=2)
    if valid is None:
        return both[:, :, -window:]
    b, h, _, d = both.shape
    real = torch.cat([torch.ones(b, window, dtype=torch.bool, device=valid.device), valid], dim=1)
    order = torch.argsort(real.to(torch.int8), dim=1, stable=True)[:, -window:]  # padding first
    return both.gather(2, order[:, None, :, None].expand(b, h, window, d))
