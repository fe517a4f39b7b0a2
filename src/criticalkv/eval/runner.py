"""The sweep runner: one full prefill per sample, every (method, budget) derived from it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from criticalkv.budgets.resolve import Budget
from criticalkv.eval.config import SweepConfig
from criticalkv.eval.store import append_result, iter_done, open_run, result_key
from criticalkv.eval.unit import SampleEvaluator, pending_pairs, record_key

logger = logging.getLogger(__name__)

__all__ = ["SweepConfig", "run_sweep", "sweep_budgets"]


def _progress(config: SweepConfig, pairs: list[tuple[str, Budget]], done: set[str]) -> tuple[int | None, int]:
    """(total, already done) result lines, for the progress bar (total unknown if the benchmark
    cannot list its samples before loading them)."""
    planned = config.bench.planned(config.draw)
    if planned is None:
        return None, 0
    wanted = [result_key(record_key(t, n, i, m, b)) for t, n, i in planned for m, b in pairs]
    return len(wanted), sum(key in done for key in wanted)


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
    for length, sample in config.iter_samples(tokenizer):
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
