"""RULER (synthetic needle, tracing, aggregation and QA tasks) as a sweep benchmark."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from criticalkv.eval.benchmarks.base import Benchmark, Draw, Slot
from criticalkv.eval.sample import Sample
from criticalkv.eval.tasks.ruler import TASK_NAMES, make_sample


@dataclass(frozen=True)
class RulerOptions:
    """``qa_source``: SQuAD/HotpotQA data for qa_1/qa_2 (``None``: the offline synthetic set)."""

    qa_source: str | None = None


class Ruler(Benchmark):
    """Generated samples: ``index`` and ``seed`` decide each one, at every length."""

    name = "ruler"
    options_type = RulerOptions

    def prepare(self, tasks: list[str] | None, options: RulerOptions) -> tuple[list[str], RulerOptions]:
        names = list(TASK_NAMES) if tasks is None else list(tasks)
        for task in names:
            if task not in TASK_NAMES:
                raise ValueError(f"unknown RULER task {task!r}; choose from: {', '.join(TASK_NAMES)}")
        return names, options

    def planned(self, draw: Draw) -> list[Slot]:
        assert draw.samples is not None  # RULER's default_samples is a count
        return [(t, n, i) for i in range(draw.samples) for n in draw.lengths for t in draw.tasks]

    def samples(self, draw: Draw, options: RulerOptions, tokenizer: Any) -> Iterator[tuple[int, Sample]]:
        for task, length, index in self.planned(draw):
            yield length, make_sample(task, tokenizer, length, index, seed=draw.seed, qa_source=options.qa_source)
