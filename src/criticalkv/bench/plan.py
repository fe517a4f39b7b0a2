"""The benchmark's runs: which (implementation, length, batch, cache) are measured, what identifies
each in ``records.jsonl``, and why a kvpress counterpart is missing."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from criticalkv.bench.config import BenchConfig
from criticalkv.bench.kvpress_decode import KVPRESS_DECODE_METHODS, kvpress_decode_unavailable
from criticalkv.bench.kvpress_impl import KVPRESS_METHODS
from criticalkv.budgets.resolve import Budget
from criticalkv.cache import CacheSpec, DecodeBudget
from criticalkv.cache.quantized import KVQuantization, quantization_from_record
from criticalkv.methods import get_method


@dataclass(frozen=True)
class Run:
    """One measurement: ``impl`` (``criticalkv`` or ``kvpress``) on a ``length``-token prompt of
    ``batch`` rows with the cache ``spec`` (the full cache's: method ``full``, budget 1.0, no decode
    budget or storage; kvpress's: the settings its press is paired on)."""

    impl: str
    length: int
    batch: int
    spec: CacheSpec

    @property
    def method(self) -> str:
        return self.spec.method.name

    @property
    def budget(self) -> Budget:
        return self.spec.budget

    @property
    def decode(self) -> DecodeBudget | None:
        return self.spec.decode

    @property
    def storage(self) -> KVQuantization | None:
        return self.spec.storage

    @property
    def key(self) -> str:
        return run_key(self.impl, self.method, self.length, self.budget, self.batch, self.decode, self.storage)


def run_key(
    impl: str,
    method: str,
    length: int,
    budget: Budget,
    batch: int,
    decode: DecodeBudget | None,
    storage: KVQuantization | None = None,
) -> str:
    """The record's key; the decode and storage settings only when set (old records keep theirs)."""
    key = f"{impl}|{method}|{length}|{float(budget)}|{batch}"
    if decode is not None:
        key += f"|decode={decode.budget}/{decode.interval}"
    if storage is not None:
        key += f"|kv={storage.bits}/{storage.group_size}/{'-' if storage.residual is None else storage.residual}"
    return key


def record_key(data: Mapping[str, Any]) -> str:
    """The key of a record read back from ``records.jsonl``."""
    budget_d = data.get("decode_budget")
    decode = None if budget_d is None else DecodeBudget(int(budget_d), int(data["decode_interval"]))
    storage = quantization_from_record(data)
    return run_key(
        data["impl"], data["method"], data["context_tokens"], data["budget"], data["batch_size"], decode, storage
    )


def kvpress_counterpart(method: str, *, decode: bool) -> bool:
    """Whether kvpress has a press for ``method``: a ``DecodingPress`` base under a decode budget
    (uniform scorers only), a prompt press otherwise."""
    return method in (KVPRESS_DECODE_METHODS if decode else KVPRESS_METHODS)


def plan_runs(
    config: BenchConfig, kvpress: bool, pair_unavailable: Callable[[int], str | None]
) -> tuple[list[Run], list[str]]:
    """Every run of ``config`` in measurement order, and a sentence for each kvpress counterpart
    that is not measured (``kvpress``: whether kvpress is compared at all; ``pair_unavailable``:
    why kvpress cannot run on a quantized cache at a bit width, ``None`` where it can).

    Each method at each budget is measured with the decode budget (unquantized) and, with
    ``config.storage``, again quantized (without the decode budget)."""
    runs: list[Run] = []
    notes: dict[str, None] = {}  # ordered, without repeats
    storage = config.storage
    unpaired = None if storage is None or not kvpress else pair_unavailable(storage.bits)
    full = CacheSpec(get_method("full"), 1.0, config.window)
    rows = config.rows()
    for length in config.context_lengths:
        for batch in config.batch_sizes:
            runs.append(Run("criticalkv", length, batch, full))
            for row in rows:
                plain = replace(row, storage=None)
                runs.append(Run("criticalkv", length, batch, plain))
                if kvpress:
                    runs += _kvpress_runs(length, batch, plain, notes)
                if storage is None:
                    continue
                quantized = replace(row, decode=None)
                runs.append(Run("criticalkv", length, batch, quantized))
                if kvpress and unpaired is not None:
                    notes[f"kvpress on a quantized cache not measured: {unpaired}"] = None
                elif kvpress:
                    runs += _kvpress_runs(length, batch, quantized, notes)
    return runs, list(notes)


def _kvpress_runs(length: int, batch: int, spec: CacheSpec, notes: dict[str, None]) -> list[Run]:
    method = spec.method.name
    if spec.decode is not None:
        reason = kvpress_decode_unavailable(method, spec.window, spec.decode.interval)
        if reason is not None:
            notes[reason] = None
            return []
    elif not kvpress_counterpart(method, decode=False):
        notes[f"{method}: kvpress has no counterpart press"] = None
        return []
    if spec.decode is None and not isinstance(spec.budget, float):
        notes[f"budget {spec.budget} tokens: kvpress's prompt presses take kept fractions only"] = None
        return []
    return [Run("kvpress", length, batch, spec)]
