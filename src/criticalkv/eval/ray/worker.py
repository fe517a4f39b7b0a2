"""The worker side of a Ray sweep: work units and the actor that evaluates them."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from criticalkv.eval.ray.ray_options import RayOptions
from criticalkv.eval.sweep.config import SweepConfig
from criticalkv.eval.sweep.unit import SampleEvaluator, UnitItem, pending_pairs

logger = logging.getLogger(__name__)

#: called on the worker after each sample of a unit (tests use one to kill a worker midway)
SampleHook = Callable[[], None]


@dataclass(frozen=True)
class WorkUnit:
    """A group of samples evaluated in a row by one worker on its loaded ``model``."""

    model: str
    items: tuple[UnitItem, ...]

    @property
    def num_records(self) -> int:
        return sum(item.num_records for item in self.items)

    def describe(self) -> str:
        first = self.items[0]
        return f"{self.model}: {len(self.items)} sample(s) from {first.sample.task}|{first.length}|{first.sample.index}"


@dataclass(frozen=True)
class UnitResult:
    """What a worker returns for a unit: the records, how long the unit took there, and the
    ``skipped.jsonl`` lines of samples it skipped (longer than the model accepts)."""

    records: list[dict[str, Any]]
    seconds: float
    worker: str
    skipped: list[dict[str, Any]] = field(default_factory=list)


class EvalWorker:
    """A Ray actor: loads the sweep's model once, then evaluates the units sent to it."""

    def __init__(self, config: SweepConfig, options: RayOptions, after_sample: SampleHook | None = None) -> None:
        self.config = config
        self.options = options
        self.after_sample = after_sample
        self.evaluator: SampleEvaluator | None = None
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def setup(self) -> dict[str, Any]:
        """Load the model (once); returns where it lives and how long loading took."""
        from criticalkv.models import load_model

        started = time.perf_counter()
        if self.evaluator is None:
            torch.set_num_threads(max(1, int(self.options.cpus_per_worker)))
            model, tokenizer = load_model(
                self.config.model,
                device=self.options.device,
                dtype=self.options.dtype,
                device_map=self.options.device_map,
            )
            self.evaluator = SampleEvaluator(self.config, model, tokenizer)
            logger.info("worker %s loaded %s", self.name, self.config.model)
        model = self.evaluator.model
        return {
            "worker": self.name,
            "device": str(self.evaluator.device),
            "device_map": getattr(model, "hf_device_map", None),
            "load_s": time.perf_counter() - started,
        }

    def run(self, unit: WorkUnit) -> UnitResult:
        """Evaluate every sample of ``unit``; the records come back together at the end."""
        if self.evaluator is None:
            self.setup()
        assert self.evaluator is not None
        started = time.perf_counter()
        records: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        for item in unit.items:
            done, skips = self.evaluator.run_or_skip(item.length, item.sample, item.pending)
            records += done
            skipped += skips
            if self.after_sample is not None:
                self.after_sample()
        return UnitResult(records, time.perf_counter() - started, self.name, skipped)


def build_units(
    config: SweepConfig, tokenizer: Any, done: Mapping[str, str | None], samples_per_unit: int
) -> tuple[list[WorkUnit], int]:
    """The sweep's pending work as units of ``samples_per_unit`` samples (in the local runner's
    order), and how many of the sweep's results are already done."""
    pairs = config.configs()
    units: list[WorkUnit] = []
    group: list[UnitItem] = []
    already = 0
    for length, sample in config.iter_samples(tokenizer):
        pending = pending_pairs(sample, length, pairs, done)
        already += len(pairs) - len(pending)
        if pending:
            group.append(UnitItem(length, sample, tuple(pending)))
        if len(group) == samples_per_unit:
            units.append(WorkUnit(config.model, tuple(group)))
            group = []
    if group:
        units.append(WorkUnit(config.model, tuple(group)))
    return units, already
