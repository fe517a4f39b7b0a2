"""Your own JSONL data (:mod:`criticalkv.eval.tasks.dataset`) as a sweep benchmark."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from criticalkv.eval.benchmarks.base import Benchmark, Draw
from criticalkv.eval.results import DATASET_CHECK
from criticalkv.eval.sample import Sample
from criticalkv.eval.tasks.dataset import describe_usage, first_per_task, load_dataset_file, unusable_lines

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetOptions:
    """``dataset``: the JSONL file of ``{context, question, answers, metric?}`` lines."""

    dataset: str | None = None


class Dataset(Benchmark):
    """Every line of the file (or the first ``samples`` lines of each task), each at its own length (recorded as
    length 0); a file without ``task`` fields is one task.

    The run identity names the file (not its path: the same file by a relative or an absolute
    path resumes); each result carries its line's content hash, so an edited line is computed
    again on resume (see :mod:`criticalkv.eval.results`).
    """

    name = "dataset"
    options_type = DatasetOptions
    per_sample_length = True
    default_samples = None  # a user's file is evaluated whole unless --samples says otherwise

    def prepare(self, tasks: list[str] | None, options: DatasetOptions) -> tuple[list[str], DatasetOptions]:
        """Reads the file once, so a missing, unreadable or empty file is refused before any work."""
        if not options.dataset:
            raise ValueError("the dataset benchmark needs --dataset PATH.jsonl")
        load_dataset_file(options.dataset)
        return list(tasks or []), options

    def unusable(self, options: DatasetOptions) -> list[dict[str, Any]]:
        assert options.dataset is not None
        path = Path(options.dataset)
        return [
            {"task": path.stem, "length": 0, "index": line, "reason": "unusable", "why": why, "meta": {"line": line}}
            for line, why in unusable_lines(path)
        ]

    def identity(self, options: DatasetOptions) -> dict[str, Any]:
        assert options.dataset is not None
        return {"dataset": Path(options.dataset).name, DATASET_CHECK: "sha256 of each line"}

    def samples(self, draw: Draw, options: DatasetOptions, tokenizer: Any) -> Iterator[tuple[int, Sample]]:
        assert options.dataset is not None
        chosen, usage = first_per_task(load_dataset_file(options.dataset), draw.samples)
        logger.info("%s", describe_usage(options.dataset, usage))
        for sample in chosen:
            yield 0, sample
