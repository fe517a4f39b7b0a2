"""What ``criticalkv bench`` measures (:class:`BenchConfig`), every input checked before a model loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from criticalkv.budgets.resolve import Budget, validate_budget
from criticalkv.cache import CacheSpec, DecodeBudget, PromptTooShort, bind_spec
from criticalkv.cache.prefill import check_window
from criticalkv.cache.quantized import KVQuantization
from criticalkv.methods import get_method
from criticalkv.scores.value_norms import NORM_PRECISIONS

KVPRESS_CHOICES = ("auto", "on", "off")


@dataclass
class BenchConfig:
    """What :func:`run_bench` measures.

    ``kvpress``: ``"auto"`` compares with kvpress when it can be imported, ``"on"`` requires
    it, ``"off"`` skips it. ``full`` (transformers' dynamic cache) is always measured: it is
    the reference of every ratio. ``head_scores``: a head-score file for head-prior methods
    (``headkv``, ``critical-headkv``) instead of the model's own. ``decode``: hold each method's
    cache at that decode budget while it decodes (kvpress: its ``DecodingPress`` at the same budget
    and interval, for the methods with a uniform scorer press). ``storage``: each method is measured
    a second time with its kept entries stored quantized
    (:class:`~criticalkv.cache.quantized.KVQuantization`), kvpress's press a second time on
    transformers' ``QuantizedCache`` (quanto, else HQQ) where it can be. Every row is a
    :class:`~criticalkv.cache.CacheSpec` (:meth:`spec`), each checked here before a model loads.
    """

    context_lengths: list[int] = field(default_factory=lambda: [4096])
    methods: list[str] = field(default_factory=lambda: ["snapkv", "critical-snapkv", "adakv", "critical-adakv"])
    budgets: list[Budget] = field(default_factory=lambda: [0.2])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    decode_tokens: int = 32
    window: int = 32
    kvpress: str = "auto"
    repeats: int = 1
    norm_precision: str | None = None
    head_scores: str | Path | None = None
    decode: DecodeBudget | None = None
    storage: KVQuantization | None = None

    def __post_init__(self) -> None:
        self.methods = [get_method(m).name for m in self.methods if m != "full"]
        self.budgets = [validate_budget(b) for b in self.budgets]
        check_window(self.window)
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError("batch sizes must be positive integers")
        if self.decode_tokens < 1:
            raise ValueError("decode_tokens must be at least 1")
        if self.repeats < 1:
            raise ValueError("repeats must be at least 1")
        if self.norm_precision is not None and self.norm_precision not in NORM_PRECISIONS:
            raise ValueError(f"norm precision must be one of {', '.join(NORM_PRECISIONS)}, not {self.norm_precision!r}")
        if self.kvpress not in KVPRESS_CHOICES:
            raise ValueError(f"kvpress must be one of {', '.join(KVPRESS_CHOICES)}, not {self.kvpress!r}")
        if self.decode is not None and not self.methods:
            raise ValueError("a decode budget needs at least one compressing method besides full")
        if self.storage is not None and not self.methods:
            raise ValueError("quantized storage needs at least one method besides full (budget 1.0: no eviction)")
        self._check_prompts(self.rows())  # every row checked by its spec, before anything is measured

    def spec(self, method: str, budget: Budget) -> CacheSpec:
        """The cache of one row: ``method`` at ``budget`` with this bench's window, decode budget and
        storage, checked as :meth:`CacheSpec.of <criticalkv.cache.CacheSpec.of>` checks it (a method
        that cannot hold the decode budget, a residual longer than a token-count budget, ...)."""
        return CacheSpec(get_method(method), budget, self.window, self.decode, self.storage)

    def rows(self) -> list[CacheSpec]:
        """The spec of every (budget, method) row, in measurement order."""
        return [self.spec(method, budget) for budget in self.budgets for method in self.methods]

    def _check_prompts(self, rows: list[CacheSpec]) -> None:
        """Every context length takes the full cache's window and every row's budget
        (:meth:`CacheSpec.check_compressible <criticalkv.cache.CacheSpec.check_compressible>`)."""
        if not self.context_lengths:
            raise ValueError("give at least one context length (--context-lengths)")
        full = CacheSpec(get_method("full"), 1.0, self.window)
        for length in self.context_lengths:
            try:
                full.check_compressible(length, "context")
            except PromptTooShort as err:
                raise PromptTooShort(
                    "<context_lengths> {length}: " + err.template, length=length, **err.values
                ) from None
            for row in rows:
                try:
                    row.check_compressible(length)
                except PromptTooShort as err:
                    where = "<budget> {row_budget} at <context_lengths> {length}: "
                    values = {"row_budget": row.budget, "length": length, **err.values}
                    raise PromptTooShort(where + err.template, **values) from None

    def check_model(self, model: Any) -> None:
        """The model takes the longest run, every method binds to it (head scores found and fitting)
        and the storage fits its head dimension (:func:`~criticalkv.cache.bind_spec`)."""
        limit = getattr(model.config, "max_position_embeddings", None)
        longest = max(self.context_lengths) + self.decode_tokens + 1
        if limit is not None and longest > limit:
            raise ValueError(
                f"the model takes at most {limit} positions; the longest context plus decode tokens needs {longest} "
                "(lower --context-lengths or --decode-tokens)"
            )
        for row in {row.method.name: row for row in self.rows()}.values():  # each method once
            bind_spec(row, model, self.head_scores)
