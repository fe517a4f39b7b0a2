"""The benchmark's runs: which (implementation, method, length, budget, batch, decode, storage)
are measured, what identifies each in ``records.jsonl``, and why a kvpress counterpart is missing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from criticalkv.bench.config import BenchConfig
from criticalkv.bench.kvpress_decode import KVPRESS_DECODE_METHODS, kvpress_decode_unavailable
from criticalkv.bench.kvpress_impl import KVPRESS_METHODS
from criticalkv.bench.ours import StorageOptions
from criticalkv.budgets.resolve import Budget


@dataclass(frozen=True)
class Run:
    """One measurement: ``decode`` (decode budget, interval) and ``storage`` (bits, group size,
    residual) are ``None`` when not set; the full cache never has either."""

    impl: str
    method: str
    length: int
    budget: Budget
    batch: int
    decode: tuple[int, int] | None = None
    storage: StorageOptions | None = None

    @property
    def key(self) -> str:
        return run_key(self.impl, self.method, self.length, self.budget, self.batch, self.decode, self.storage)


def run_key(
    impl: str,
    method: str,
    length: int,
    budget: Budget,
    batch: int,
    decode: tuple[int, int] | None,
    storage: StorageOptions | None = None,
) -> str:
    """The record's key; the decode and storage settings only when set (old records keep theirs)."""
    key = f"{impl}|{method}|{length}|{float(budget)}|{batch}"
    if decode is not None:
        key += f"|decode={decode[0]}/{decode[1]}"
    if storage is not None:
        key += f"|kv={storage[0]}/{storage[1]}/{'-' if storage[2] is None else storage[2]}"
    return key


def record_key(data: dict[str, Any]) -> str:
    """The key of a record read back from ``records.jsonl``."""
    budget_d = data.get("decode_budget")
    decode = None if budget_d is None else (int(budget_d), int(data["decode_interval"]))
    bits = data.get("kv_bits")
    storage = None if bits is None else (int(bits), int(data["kv_group_size"]), data.get("kv_residual"))
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
    why kvpress cannot run on a quantized cache at a bit width, ``None`` where it can)."""
    runs: list[Run] = []
    notes: dict[str, None] = {}  # ordered, without repeats
    decode, storage = config.decode, config.storage
    unpaired = None if storage is None or not kvpress else pair_unavailable(storage[0])
    for length in config.context_lengths:
        for batch in config.batch_sizes:
            runs.append(Run("criticalkv", "full", length, 1.0, batch))
            for budget in config.budgets:
                for method in config.methods:
                    runs.append(Run("criticalkv", method, length, budget, batch, decode))
                    if kvpress:
                        runs += _kvpress_runs(method, length, budget, batch, decode, None, config.window, notes)
                    if storage is None:
                        continue
                    runs.append(Run("criticalkv", method, length, budget, batch, None, storage))
                    if kvpress and unpaired is not None:
                        notes[f"kvpress on a quantized cache not measured: {unpaired}"] = None
                    elif kvpress:
                        runs += _kvpress_runs(method, length, budget, batch, None, storage, config.window, notes)
    return runs, list(notes)


def _kvpress_runs(
    method: str,
    length: int,
    budget: Budget,
    batch: int,
    decode: tuple[int, int] | None,
    storage: StorageOptions | None,
    window: int,
    notes: dict[str, None],
) -> list[Run]:
    if decode is not None:
        reason = kvpress_decode_unavailable(method, window, decode[1])
        if reason is not None:
            notes[reason] = None
            return []
    elif not kvpress_counterpart(method, decode=False):
        notes[f"{method}: kvpress has no counterpart press"] = None
        return []
    if decode is None and not isinstance(budget, float):
        notes[f"budget {budget} tokens: kvpress's prompt presses take kept fractions only"] = None
        return []
    return [Run("kvpress", method, length, budget, batch, decode, storage)]
