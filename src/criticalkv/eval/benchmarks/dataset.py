"""Your own JSONL data (:mod:`criticalkv.eval.dataset`) as a sweep benchmark."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from criticalkv.eval.benchmarks.base import Benchmark, Draw
from criticalkv.eval.dataset import describe_usage, first_per_task, load_dataset_file
from criticalkv.eval.sample import Sample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetOptions:
    """``dataset``: the JSONL file of ``{context, question, answers, metric?}`` lines."""

    dataset: str | None = None


class Dataset(Benchmark):
    """The first ``samples`` lines of each task of the file, each at its own length (recorded as
    length 0); a file without ``task`` fields is one task."""

    name = "dataset"
    options_type = DatasetOptions

    def prepare(self, tasks: list[str] | None, options: DatasetOptions) -> tuple[list[str], DatasetOptions]:
        if not options.dataset:
            raise ValueError("the dataset benchmark needs --dataset PATH.jsonl")
        return list(tasks or []), options

    def samples(self, draw: Draw, options: DatasetOptions, tokenizer: Any) -> Iterator[tuple[int, Sample]]:
        assert options.dataset is not None
        chosen, usage = first_per_task(load_dataset_file(options.dataset), draw.samples)
        logger.info("%s", describe_usage(options.dataset, usage))
        for sample in chosen:
            yield 0, sample
