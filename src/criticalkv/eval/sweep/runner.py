"""The sweep runner: one full prefill per sample, every (method, budget) derived from it."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from criticalkv.budgets.resolve import Budget
from criticalkv.eval.results import (
    append_result,
    append_skipped,
    content_hash,
    done_index,
    is_done,
    result_key,
)
from criticalkv.eval.sweep.config import SweepConfig
from criticalkv.eval.sweep.folder_hold import record_unusable, sweep_folder
from criticalkv.eval.sweep.unit import SampleEvaluator, pending_pairs, record_key
from criticalkv.runs import DEFAULT_WAIT

logger = logging.getLogger(__name__)

__all__ = ["SweepConfig", "run_sweep", "sweep_budgets"]


def progress_counts(
    config: SweepConfig, pairs: list[tuple[str, Budget]], done: Mapping[str, str | None] | set[str]
) -> tuple[int | None, int]:
    """(total, already done) result lines, for the progress bar (total unknown if the benchmark
    cannot list its samples before loading them)."""
    planned = config.bench.planned(config.draw)
    if planned is None:
        return None, 0
    wanted = [result_key(record_key(t, n, i, m, b)) for t, n, i in planned for m, b in pairs]
    if isinstance(done, set):
        return len(wanted), sum(key in done for key in wanted)
    return len(wanted), sum(is_done(done, key, None) for key in wanted)


def run_sweep(config: SweepConfig, model: Any, tokenizer: Any, *, wait: float = DEFAULT_WAIT) -> Path:
    """Run (or resume) a sweep; results go to ``config.out/results.jsonl``.

    Samples run one after another on ``model`` (see :class:`~criticalkv.eval.sweep.unit.SampleEvaluator`);
    :func:`criticalkv.eval.ray.runner.run_sweep_ray` runs the same work on a Ray cluster. Everything
    that can be checked is checked before the folder is touched; then the run holds the folder's
    writer lock, waiting up to ``wait`` seconds for another writer (see
    :func:`~criticalkv.eval.sweep.folder_hold.sweep_folder`). A ``--dataset`` line longer than the model
    accepts is skipped with a warning and listed in ``skipped.jsonl``.
    """
    evaluator = SampleEvaluator(config, model, tokenizer)  # refuses lengths the model cannot take
    pairs = config.configs()
    with sweep_folder(Path(config.out), config.identity(), config.to_json(), wait) as out:
        done = done_index(out)
        record_unusable(out, config)
        total, initial = progress_counts(config, pairs, done)
        bar = tqdm(total=total, desc="eval", unit="run", initial=initial)
        for length, sample in config.iter_samples(tokenizer):
            pending = pending_pairs(sample, length, pairs, done)
            if not pending:
                continue
            records, skipped = evaluator.run_or_skip(length, sample, pending)
            for skip in skipped:
                append_skipped(out, skip)
            for record in records:
                append_result(out, record)
                done[result_key(record)] = content_hash(record)
                bar.update(1)
        bar.close()
    return out


def sweep_budgets(values: Sequence[Budget]) -> list[Budget]:
    """Sorted, de-duplicated budgets."""
    return sorted(set(values), key=float)
