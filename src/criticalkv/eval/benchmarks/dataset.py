"""Your own JSONL data (:mod:`criticalkv.eval.dataset`) as a sweep benchmark."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from criticalkv.eval.benchmarks.base import Benchmark, Draw
from criticalkv.eval.dataset import load_dataset_file
from criticalkv.eval.sample import Sample


@dataclass(frozen=True)
class DatasetOptions:
    """``dataset``: the JSONL file of ``{context, question, answers, metric?}`` lines."""

    dataset: str | None = None


class Dataset(Benchmark):
    """The file's first ``samples`` lines, each at its own length (recorded as length 0)."""

    name = "dataset"
    options_type = DatasetOptions

    def prepare(self, tasks: list[str] | None, options: DatasetOptions) -> tuple[list[str], DatasetOptions]:
        if not options.dataset:
            raise ValueError("the dataset benchmark needs --dataset PATH.jsonl")
        return list(tasks or []), options

    def samples(self, draw: Draw, options: DatasetOptions, tokenizer: Any) -> Iterator[tuple[int, Sample]]:
        assert options.dataset is not None
        for sample in load_dataset_file(options.dataset)[: draw.samples]:
            yield 0, sample
