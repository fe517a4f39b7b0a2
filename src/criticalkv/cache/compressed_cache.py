"""The physically compressed, head-varying KV cache (a transformers ``Cache``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache

from criticalkv.budgets.resolve import Budget, resolve_budget
from criticalkv.cache.decode import DecodeCompression
from criticalkv.cache.layer import CompressedLayer
from criticalkv.cache.persist import load_cache, save_cache
from criticalkv.cache.prefill import DEFAULT_WINDOW, JointPrefill, bounded, state_from_prefill, synchronize
from criticalkv.cache.spec import CacheSpec, bind_spec
from criticalkv.cache.storage_table import new_storage, storage_class
from criticalkv.cache.tokens import TokenRecord
from criticalkv.defaults import DEFAULT_METHOD
from criticalkv.methods import HeadScoresArg, Method
from criticalkv.needs import QueriesNeeded
from criticalkv.scores.queries import resolve_num_queries
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)


class CompressedCache(Cache):
    """A KV cache whose prompt is compressed by ``method`` at ``budget``, physically.

    Pass it to ``model.generate(..., past_key_values=cache)`` (or a forward call) on a model
    prepared with :func:`criticalkv.attach`: the prefill runs with the full cache, then each
    layer keeps only its selected entries, per KV head. Decoding attends over what was kept.

    Parameters
    ----------
    num_layers : number of decoder layers of the model.
    method : a registered name (see :func:`criticalkv.available_methods`) or a :class:`Method`.
    budget : entries kept per KV head, as a fraction of the prompt in (0, 1] or a token count.
    window : the observation window (its entries are always kept).
    **options : the decode budget and storage keywords of :meth:`CacheSpec.of` (``decode_budget``,
        ``kv_bits``, ...): entries per KV head the cache is held to while it decodes (see
        :class:`~criticalkv.cache.decode.budget.DecodeCompression`) and the storage precision (16: the
        model's dtype; 8 or 4: quantized, see :class:`~criticalkv.cache.quantized.precision.KVQuantization`).
        A :class:`CacheSpec` built elsewhere makes a cache through :meth:`from_spec`.

    The method must be bound (:attr:`Method.bound`): methods with head-prior budgets
    (``headkv``, ``critical-headkv``) get their model's head scores from :meth:`for_model` or
    :func:`criticalkv.methods.bind` before a cache exists; the cache itself never looks any up.

    What the method needs is read from :attr:`Method.needs`: scores that read more prompt queries
    than the window (``needs.queries``, e.g. H2O's) get them, the layer state handed to the method
    keeping as many as they declare.

    Methods whose budgets span layers (``layer-defensivekv``, ``needs.cross_layer``) cannot
    select a layer before every layer's scores are known. When their selection keeps each head's
    top-ranked entries (``layer-defensivekv``), the cache holds of each prefilled layer
    only the entries that can still win the joint selection, then selects over all layers jointly:
    the same selection, within ``(b / T + 1 / L)`` x the full cache during the prompt
    (:mod:`~criticalkv.cache.prefill.joint`). Others (``critical-kvzip``) keep every layer's full
    prefill state until the last one, as in the released code. :attr:`prefill_peak_bytes` is the
    most KV held at once while the prompt was compressed.

    **One prompt per cache.** Once it holds a compressed prompt, a cache accepts only
    continuations of it: ``generate``'s decode steps, a question appended after the context
    (question-agnostic mode), teacher-forced answer tokens, or ``generate`` called again with a
    prompt that begins with the tokens the cache holds (with an attention mask that covers them).
    A new prompt raises ``ValueError`` (checked on every forward of an attached model) instead of
    being appended to the old entries: use a fresh cache, or :meth:`fork` the compressed context
    once per question.
    """

    def __init__(
        self,
        num_layers: int,
        method: str | Method = DEFAULT_METHOD,
        budget: Budget = 0.2,
        window: int = DEFAULT_WINDOW,
        **options: Any,
    ) -> None:
        self._build(num_layers, CacheSpec.of(method, budget, window, **options))

    @classmethod
    def from_spec(cls, num_layers: int, spec: CacheSpec) -> CompressedCache:
        """An empty cache of ``num_layers`` layers as ``spec`` describes (its method bound)."""
        cache = cls.__new__(cls)
        cache._build(num_layers, spec)
        return cache

    def _build(self, num_layers: int, spec: CacheSpec) -> None:
        if not spec.method.bound:
            name = spec.method.name
            raise ValueError(
                f"method {name!r} needs head importance scores bound to the model before a cache exists: use "
                f"CompressedCache.for_model(model, {name!r}, ...) or criticalkv.methods.bind(get_method({name!r}), "
                "model[, head_scores='scores.json'])"
            )
        #: what this cache is (method, budget, window, decode budget, storage); the fields below read it
        self.spec = spec
        self.method, self.budget, self.window, self.quantization = spec.method, spec.budget, spec.window, spec.storage
        self.num_layers = num_layers
        self.real_prompt_tokens: torch.Tensor | None = None
        #: (B,) entries per KV head on average each row keeps, resolved from ``budget`` at the prefill
        self.budget_tokens: torch.Tensor | None = None
        #: cross-layer methods: the layers seen so far in this prefill, compressed after the last one
        self._deferred: dict[int, tuple[CompressedLayer, LayerState]] = {}
        self._joint: JointPrefill | None = None  # the same, holding only candidates (bounded methods)
        #: the most KV bytes held at once while the prompt was compressed (see :meth:`_note_prefill_bytes`)
        self.prefill_peak_bytes = 0
        #: the token ids fed so far, to recognise a continuation (see the class docstring)
        self.tokens = TokenRecord()
        #: seconds spent selecting and storing kept entries (all layers); with ``synchronize_timing``
        #: the device is synchronised around each layer so the time is exact on CUDA (benchmarks only)
        self.compress_seconds = 0.0
        self.synchronize_timing = False
        layers = [CompressedLayer(i, self._compress_layer, new_storage(self.quantization)) for i in range(num_layers)]
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self.decode: DecodeCompression | None = None  # the decode budget, if any
        if spec.decode is not None:
            held = spec.decode
            self.decode = DecodeCompression(self.method, held.budget, held.interval, self.window, num_layers)
            self.decode.install(self.compressed_layers)

    @classmethod
    def for_model(
        cls,
        model: Any,
        method: str | Method = DEFAULT_METHOD,
        budget: Budget = 0.2,
        head_scores: HeadScoresArg = None,
        **kwargs: Any,
    ) -> CompressedCache:
        """A cache sized for ``model`` (its number of decoder layers), with head scores bound
        for ``model`` if the method needs them (an error up front if there are none).
        ``kwargs``: the other keyword arguments of :class:`CompressedCache` (``window``, ``kv_bits``, ...)."""
        spec = CacheSpec.of(method, budget, config=model.config, **kwargs)
        return cls.from_spec(model.config.num_hidden_layers, bind_spec(spec, model, head_scores))

    @classmethod
    def from_states(
        cls,
        states: Sequence[LayerState],
        method: str | Method,
        budget: Budget,
        window: int | None = None,
        head_scores: HeadScoresArg = None,
        **options: Any,
    ) -> CompressedCache:
        """Compress captured prefill states (see :class:`CaptureCache`) without a new prefill.

        Head scores are bound for the model the states come from (read off the attention
        modules' config) unless ``head_scores`` is given. ``options``: the storage and decode
        keywords of :class:`CompressedCache`.
        """
        if not states:
            raise ValueError("no layer states to compress")
        window = states[0].window if window is None else window
        config = getattr(states[0].module, "config", None)  # the model the attention module belongs to
        spec = CacheSpec.of(method, budget, window, **options)
        cache = cls.from_spec(len(states), bind_spec(spec, config, head_scores))
        cache.compress_states(states)
        return cache

    def compress_states(self, states: Sequence[LayerState]) -> None:
        """Compress captured prefill states (one per layer) into this empty cache, at its window."""
        if len(states) != self.num_layers:
            raise ValueError(f"got {len(states)} layer states for a cache of {self.num_layers} layers")
        for layer, state in zip(self.compressed_layers, states, strict=True):
            if state.window != self.window:
                state = LayerState(**{**state.__dict__, "window": self.window})
            self._compress_state(layer, state)

    @property
    def compressed_layers(self) -> list[CompressedLayer]:
        return self.layers  # type: ignore[return-value]

    # --- compression -----------------------------------------------------------------------------
    def _compress_layer(
        self,
        layer: CompressedLayer,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        module: Any,
    ) -> None:
        state = state_from_prefill(
            query,
            keys,
            values,
            valid,
            module,
            window=self.window,
            layer_idx=layer.layer_idx,
            num_layers=self.num_layers,
            num_queries=resolve_num_queries(self.queries_needed, query.shape[2]),
        )
        if self.method.needs.cross_layer and state.queries.shape[2] < query.shape[2]:
            # held until the last layer: a copy of the few queries kept frees the prefill's full query tensor
            state = LayerState(**{**state.__dict__, "queries": state.queries.clone()})
        self._compress_state(layer, state)

    @property
    def queries_needed(self) -> QueriesNeeded:
        """Prompt queries the method's scores read (``None``: the window; ``'all'``: every one)."""
        return self.method.needs.queries

    def _compress_state(self, layer: CompressedLayer, state: LayerState) -> None:
        if self.synchronize_timing:
            synchronize(state.keys.device)
        started = time.perf_counter()
        self._select_and_store(layer, state)
        if self.synchronize_timing:
            synchronize(state.keys.device)
        self.compress_seconds += time.perf_counter() - started

    def _select_and_store(self, layer: CompressedLayer, state: LayerState) -> None:
        if self.budget_tokens is None or self.budget_tokens.shape[0] != state.batch_size:
            self.real_prompt_tokens = state.lengths
            self.budget_tokens = resolve_budget(self.budget, state.lengths, self.window)
            if self.decode is not None:  # held at the decode budget from the start (see DecodeCompression)
                self.budget_tokens = self.budget_tokens.clamp(max=self.decode.budget)
            if self.quantization is not None:  # against the budget asked for, not a layer's share of it
                storage_class(self.quantization).check_budget(self.quantization, int(self.budget_tokens.min()))
        if self.method.needs.cross_layer:
            self._defer(layer, state)
            return
        keep = self.method.keep_mask(state, self.budget_tokens)
        layer.set_prefix(state.keys, state.values, keep)
        self._note_prefill_bytes(state)
        if self.decode is not None:
            self.decode.after_prefill(layer, state)

    def _defer(self, layer: CompressedLayer, state: LayerState) -> None:
        """Cross-layer budgets: hold the layer until the last one (only its candidates, when the
        selection allows, :mod:`~criticalkv.cache.prefill.joint`), then select over all layers."""
        assert self.budget_tokens is not None
        if bounded(self.method):
            if self._joint is None:
                self._joint = JointPrefill(self.method, self.num_layers)
            done = self._joint.add(layer, state, self.budget_tokens)
            self._note_prefill_bytes(state, 0 if done else self._joint.high_water)
            if done:
                self._start_decode(self._joint.stored)
                self._joint = None
            return
        self._deferred[layer.layer_idx] = (layer, state)
        deferred = sum(_kv_bytes(s) for _, s in self._deferred.values())
        self._note_prefill_bytes(state, deferred - _kv_bytes(state))
        if len(self._deferred) == self.num_layers:
            self._compress_jointly()

    def _note_prefill_bytes(self, state: LayerState, held: int = 0) -> None:
        """Update :attr:`prefill_peak_bytes`: the layers stored, ``held`` bytes of layers waiting for a
        joint selection, and the layer being compressed, whole (the prefill holds it)."""
        now = self.kv_bytes() + held + _kv_bytes(state)
        self.prefill_peak_bytes = max(self.prefill_peak_bytes, now)

    def _compress_jointly(self) -> None:
        """Select over every deferred layer at once (cross-layer budgets), then store each layer."""
        assert self.budget_tokens is not None
        pairs = [self._deferred[i] for i in sorted(self._deferred)]
        self._deferred = {}
        keeps = self.method.keep_masks([state for _, state in pairs], self.budget_tokens)
        for (layer, state), keep in zip(pairs, keeps, strict=True):
            layer.set_prefix(state.keys, state.values, keep)
        logger.debug("%s: compressed %d layers jointly", self.method.name, len(pairs))
        self._start_decode(pairs)

    def _start_decode(self, layers: Sequence[tuple[CompressedLayer, LayerState]]) -> None:
        """Under a decode budget, hand the jointly selected layers to it, each at its share."""
        if self.decode is not None:
            self.decode.after_joint_prefill(layers)

    # --- reuse -----------------------------------------------------------------------------------
    def fork(self) -> CompressedCache:
        """A copy sharing the compressed prompt (read-only) with an empty tail.

        Use it to ask several questions of one compressed context (question-agnostic mode).
        """
        clone = type(self).from_spec(self.num_layers, replace(self.spec, decode=None))
        clone.layers = [layer.fork(clone._compress_layer) for layer in self.compressed_layers]
        if self.decode is not None:  # its own decode budget: the two decode independently
            clone.decode = self.decode.fork()
            clone.decode.install(clone.compressed_layers)
        clone.real_prompt_tokens = self.real_prompt_tokens
        clone.budget_tokens = self.budget_tokens
        clone.tokens = self.tokens.head(self.compressed_layers[0].prefix_len)
        return clone

    def holds_prompt(self) -> bool:
        """Whether a compressed prompt is stored (then only continuations are accepted)."""
        return any(layer.holds_prompt for layer in self.compressed_layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.tokens.select(beam_idx)
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.tokens.select(indices)
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.tokens.repeat_rows(repeats)
        super().batch_repeat_interleave(repeats)

    def save(self, path: str | Path, model: Any, tokenizer: Any = None, **fields: Any) -> int:
        """Write the cache to ``path`` atomically; returns the file's bytes (:mod:`~criticalkv.cache.persist`)."""
        return save_cache(self, path, model, tokenizer, **fields)

    @classmethod
    def load(cls, path: str | Path, model: Any, tokenizer: Any = None) -> CompressedCache:
        """A cache saved by :meth:`save`, checked whole and for this model and tokenizer."""
        return load_cache(cls, path, model, tokenizer)

    # --- accounting ------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes the cache's keys and values occupy now (tail capacity included)."""
        return sum(layer.nbytes() for layer in self.compressed_layers)

    def kv_bytes_peak(self) -> int:
        """The most bytes the cache held so far (under a decode budget, just before a re-selection)."""
        return max(self.kv_bytes(), 0 if self.decode is None else self.decode.peak_bytes)

    def kv_bytes_full(self) -> int:
        """Bytes an uncompressed cache would hold for the same real tokens."""
        total = 0
        for layer in self.compressed_layers:
            if not layer.holds_prompt or self.real_prompt_tokens is None:
                continue
            per_token = 2 * layer.num_kv_heads * layer.head_dim * torch.empty((), dtype=layer.dtype).element_size()
            appended = layer.tail_len if self.decode is None else self.decode.appended(layer)
            tokens = int(self.real_prompt_tokens.sum()) + layer.batch_size * appended
            total += tokens * per_token
        return total

    def kept_entries(self) -> torch.Tensor:
        """(L, B, H_kv) entries held per layer and head."""
        return torch.stack([layer.kept_per_head() for layer in self.compressed_layers])

    def keep_masks(self) -> list[torch.Tensor]:
        """Per layer, the (B, H_kv, T) bool mask of kept prompt positions."""
        masks = []
        for layer in self.compressed_layers:
            if layer.keep is None:
                raise ValueError("the cache holds no compressed prompt yet")
            masks.append(layer.keep)
        return masks


def _kv_bytes(state: LayerState) -> int:
    """Bytes of a layer state's keys and values."""
    return sum(t.numel() * t.element_size() for t in (state.keys, state.values))
