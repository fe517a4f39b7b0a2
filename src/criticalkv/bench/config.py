"""What ``criticalkv bench`` measures (:class:`BenchConfig`), every input checked before a model loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from criticalkv.bench.ours import StorageOptions
from criticalkv.budgets.resolve import Budget, resolve_budget, validate_budget
from criticalkv.cache.decode import DEFAULT_INTERVAL, check_decode_budget
from criticalkv.cache.prefill import check_window
from criticalkv.cache.quantized import check_quantized_decode, default_group_size, quantization_for
from criticalkv.methods import bind, get_method
from criticalkv.options import OptionError
from criticalkv.scores.value_norms import NORM_PRECISIONS

KVPRESS_CHOICES = ("auto", "on", "off")


@dataclass
class BenchConfig:
    """What :func:`run_bench` measures.

    ``kvpress``: ``"auto"`` compares with kvpress when it can be imported, ``"on"`` requires
    it, ``"off"`` skips it. ``full`` (transformers' dynamic cache) is always measured: it is
    the reference of every ratio. ``head_scores``: a head-score file for head-prior methods
    (``headkv``, ``critical-headkv``) instead of the model's own. ``decode_budget``: hold each
    method's cache at that many entries per KV head while it decodes, re-selecting every
    ``decode_interval`` new entries per head (kvpress: its ``DecodingPress`` at the same budget
    and interval, for the methods with a uniform scorer press). ``kv_bits`` 8 or 4: each method is
    measured a second time with its kept entries stored quantized (``kv_group_size`` entries per
    scale and zero point, the newest ``kv_residual`` tokens exact; ``None``: the cache's defaults),
    kvpress's press a second time on transformers' ``QuantizedCache`` (quanto, else HQQ) where it can be.
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
    decode_budget: int | None = None
    decode_interval: int = DEFAULT_INTERVAL
    kv_bits: int | None = None
    kv_group_size: int | None = None
    kv_residual: int | None = None

    def __post_init__(self) -> None:
        self.methods = [get_method(m).name for m in self.methods if m != "full"]
        self.budgets = [validate_budget(b) for b in self.budgets]
        check_window(self.window)
        if not self.context_lengths or any(n <= self.window for n in self.context_lengths):
            raise ValueError(f"context lengths must be longer than the window ({self.window} tokens)")
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
        if self.decode_budget is not None:
            self._check_decode()
        self._check_storage()
        for length in self.context_lengths:  # every (length, budget) resolves before anything is measured
            for budget in self.budgets:
                try:
                    resolve_budget(budget, torch.tensor([length]), self.window)
                except ValueError as err:
                    raise ValueError(f"--budgets {budget} at --context-lengths {length}: {err}") from None

    def _check_storage(self) -> None:
        if self.kv_bits is None:
            if self.kv_group_size is not None or self.kv_residual is not None:
                raise OptionError(
                    "<kv_group_size> and <kv_residual> set how <kv_bits> quantizes: give <kv_bits> 8 or 4 too"
                )
            return
        spec = quantization_for(self.kv_bits, self.kv_group_size, self.kv_residual)
        if spec is None:
            raise ValueError(f"kv_bits {self.kv_bits} is the model's own dtype: give 8 or 4 (or leave it out)")
        check_quantized_decode(spec, self.decode_budget)  # the cache's own sentence, before any work
        if not self.methods:
            raise ValueError("quantized storage needs at least one method besides full (budget 1.0: no eviction)")
        for budget in self.budgets:
            if isinstance(budget, int):
                spec.check_budget(budget)

    @property
    def storage(self) -> StorageOptions | None:
        """(bits, group size, residual) of the quantized rows, or ``None`` without ``kv_bits``."""
        if self.kv_bits is None:
            return None
        group = default_group_size(self.kv_bits) if self.kv_group_size is None else self.kv_group_size
        return (self.kv_bits, group, self.kv_residual)

    def _check_decode(self) -> None:
        if not self.methods:
            raise ValueError("a decode budget needs at least one compressing method besides full")
        for name in self.methods:
            check_decode_budget(get_method(name), self.window, self.decode_budget, self.decode_interval)

    @property
    def decode(self) -> tuple[int, int] | None:
        """(decode budget, interval), or ``None`` without a decode budget."""
        return None if self.decode_budget is None else (self.decode_budget, self.decode_interval)

    def check_model(self, model: Any) -> None:
        limit = getattr(model.config, "max_position_embeddings", None)
        longest = max(self.context_lengths) + self.decode_tokens + 1
        if limit is not None and longest > limit:
            raise ValueError(
                f"the model takes at most {limit} positions; the longest context plus decode tokens needs {longest} "
                "(lower --context-lengths or --decode-tokens)"
            )
        for name in self.methods:  # head scores found and fitting the model, before anything is measured
            bind(get_method(name), model, self.head_scores)
        if self.storage is not None:  # the group size divides the model's head dimension
            quantization_for(self.storage[0], self.storage[1], self.storage[2], config=model.config)
