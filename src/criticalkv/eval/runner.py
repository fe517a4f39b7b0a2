"""The sweep runner: one full prefill per sample, every (method, budget) derived from it."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from criticalkv.budgets.resolve import Budget
from criticalkv.cache.compressed_cache import check_window
from criticalkv.eval.dataset import load_dataset_file
from criticalkv.eval.longbench.samples import iter_samples as longbench_samples
from criticalkv.eval.longbench.samples import prepare_sweep as prepare_longbench
from criticalkv.eval.longbench.tasks import MAX_NEW_TOKENS as LONGBENCH_MAX_NEW_TOKENS
from criticalkv.eval.ruler import TASK_NAMES, make_sample
from criticalkv.eval.sample import Sample
from criticalkv.eval.store import append_result, iter_done, open_run, result_key
from criticalkv.eval.unit import SampleEvaluator, pending_pairs
from criticalkv.methods import get_method
from criticalkv.runtime import DEFAULT_WINDOWS, check_mode

logger = logging.getLogger(__name__)


@dataclass
class SweepConfig:
    """What a sweep runs. ``identity()`` must match to resume into an existing folder."""

    out: Path
    benchmark: str = "ruler"
    tasks: list[str] = field(default_factory=lambda: list(TASK_NAMES))
    lengths: list[int] = field(default_factory=lambda: [1024])
    methods: list[str] = field(default_factory=lambda: ["full", "snapkv", "critical-snapkv", "adakv", "critical-adakv"])
    budgets: list[Budget] = field(default_factory=lambda: [0.1, 0.2, 0.4])
    samples: int = 10
    mode: str = "question-aware"
    model: str = "default"
    window: int | None = None
    seed: int = 0
    max_new_tokens: int | None = None
    chat: bool = True
    qa_source: str | None = None
    dataset: str | None = None
    data_dir: str | None = None
    longbench_e: bool = False

    def __post_init__(self) -> None:
        check_mode(self.mode)
        self.window = check_window(DEFAULT_WINDOWS[self.mode] if self.window is None else self.window)
        if self.benchmark not in ("ruler", "dataset", "longbench"):
            raise ValueError(
                f"benchmark must be 'ruler', 'longbench' or 'dataset' (or use --dataset), not {self.benchmark!r}"
            )
        if self.benchmark == "longbench":
            # the default task list is RULER's; for LongBench it means every dataset
            tasks = ["all"] if self.tasks == list(TASK_NAMES) else self.tasks
            self.tasks, self.data_dir = prepare_longbench(tasks, self.data_dir, self.longbench_e)
            if self.max_new_tokens is None:  # each dataset generates up to its own LongBench length
                self.max_new_tokens = max(LONGBENCH_MAX_NEW_TOKENS.values())
        elif self.data_dir is not None or self.longbench_e:
            raise ValueError("--data-dir and --longbench-e are LongBench options; add --benchmark longbench")
        if self.benchmark == "dataset" and not self.dataset:
            raise ValueError("the dataset benchmark needs --dataset PATH.jsonl")
        for task in self.tasks if self.benchmark == "ruler" else []:
            if task not in TASK_NAMES:
                raise ValueError(f"unknown RULER task {task!r}; choose from: {', '.join(TASK_NAMES)}")
        for method in self.methods:
            get_method(method)
        if self.samples < 1:
            raise ValueError("samples must be at least 1")
        if any(n < 128 for n in self.lengths):
            raise ValueError("lengths must be at least 128 tokens")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")

    def identity(self) -> dict[str, Any]:
        keys: tuple[str, ...] = (
            "benchmark",
            "model",
            "mode",
            "window",
            "seed",
            "max_new_tokens",
            "chat",
            "qa_source",
            "dataset",
        )
        if self.benchmark == "longbench":
            keys += ("data_dir", "longbench_e")
        return {k: getattr(self, k) for k in keys}

    def configs(self) -> list[tuple[str, Budget]]:
        """(method, budget) pairs: ``full`` once at budget 1.0, every other method at every budget."""
        out: list[tuple[str, Budget]] = [("full", 1.0)] if "full" in self.methods else []
        return out + [(m, b) for m in self.methods if m != "full" for b in self.budgets]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["out"] = str(self.out)
        return data


def _samples(config: SweepConfig, tokenizer: Any) -> Iterator[tuple[int, Sample]]:
    if config.benchmark == "dataset":
        assert config.dataset is not None
        for sample in load_dataset_file(config.dataset)[: config.samples]:
            yield 0, sample
        return
    if config.benchmark == "longbench":
        yield from longbench_samples(
            config.tasks, tokenizer, config.lengths, config.samples, config.data_dir, config.longbench_e
        )
        return
    # sample-major: an interrupted sweep has covered every task and length with fewer samples
    for index in range(config.samples):
        for length in config.lengths:
            for task in config.tasks:
                yield length, make_sample(task, tokenizer, length, index, seed=config.seed, qa_source=config.qa_source)


def _progress(config: SweepConfig, pairs: list[tuple[str, Budget]], done: set[str]) -> tuple[int | None, int]:
    """(total, already done) result lines of a RULER sweep, for the progress bar (total unknown otherwise)."""
    if config.benchmark != "ruler":
        return None, 0
    total = len(config.tasks) * len(config.lengths) * config.samples * len(pairs)
    indices = range(config.samples)
    wanted = (f"{t}|{n}|{i}|{m}|{b}" for t in config.tasks for n in config.lengths for i in indices for m, b in pairs)
    return total, sum(key in done for key in wanted)


def run_sweep(config: SweepConfig, model: Any, tokenizer: Any) -> Path:
    """Run (or resume) a sweep; results go to ``config.out/results.jsonl``.

    Samples run one after another on ``model`` (see :class:`~criticalkv.eval.unit.SampleEvaluator`);
    :func:`criticalkv.eval.ray_runner.run_sweep_ray` runs the same work on a Ray cluster.
    """
    out = Path(config.out)
    open_run(out, config.identity(), config.to_json())
    done = set(iter_done(out))
    evaluator = SampleEvaluator(config, model, tokenizer)
    pairs = config.configs()
    total, initial = _progress(config, pairs, done)
    bar = tqdm(total=total, desc="eval", unit="run", initial=initial)
    for length, sample in _samples(config, tokenizer):
        pending = pending_pairs(sample, length, pairs, done)
        if not pending:
            continue
        for record in evaluator.run(length, sample, pending):
            append_result(out, record)
            done.add(result_key(record))
            bar.update(1)
    bar.close()
    return out


def sweep_budgets(values: Sequence[Budget]) -> list[Budget]:
    """Sorted, de-duplicated budgets."""
    return sorted(set(values), key=float)
