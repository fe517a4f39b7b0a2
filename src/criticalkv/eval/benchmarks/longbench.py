"""LongBench and LongBench-E (real long-context datasets) as a sweep benchmark."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from criticalkv.eval.benchmarks.base import Benchmark, Draw
from criticalkv.eval.longbench.samples import iter_samples, prepare_sweep
from criticalkv.eval.longbench.tasks import MAX_NEW_TOKENS
from criticalkv.eval.sample import Sample


@dataclass(frozen=True)
class LongBenchOptions:
    """``data_dir``: a folder of LongBench's JSONL files (``None``: the ``datasets`` hub);
    ``longbench_e``: LongBench-E (13 datasets, length buckets)."""

    data_dir: str | None = None
    longbench_e: bool = False


class LongBench(Benchmark):
    """The first ``samples`` rows of each dataset, middle-truncated to each length."""

    name = "longbench"
    options_type = LongBenchOptions
    #: each dataset then generates up to its own LongBench length
    max_new_tokens = max(MAX_NEW_TOKENS.values())

    def prepare(self, tasks: list[str] | None, options: LongBenchOptions) -> tuple[list[str], LongBenchOptions]:
        """Groups (``all``, ``en``, ``zh``) expanded and ``data_dir`` made absolute; raises if data
        or jieba (the Chinese metrics) is missing."""
        names, data_dir = prepare_sweep(["all"] if tasks is None else tasks, options.data_dir, options.longbench_e)
        return names, replace(options, data_dir=data_dir)

    def samples(self, draw: Draw, options: LongBenchOptions, tokenizer: Any) -> Iterator[tuple[int, Sample]]:
        assert draw.samples is not None  # LongBench's default_samples is a count
        yield from iter_samples(
            draw.tasks, tokenizer, draw.lengths, draw.samples, options.data_dir, options.longbench_e
        )
