"""The perturbation experiment: each base method against its Critical variant, per head.

For every needle sample (RULER-style context, question-aware prompt) one full prefill is run and
compressed by every (method, budget). Per layer and query head it measures, over the
observation-window queries and over the decode queries of the teacher-forced gold answer:

* the head-output perturbation ``||o - o_hat||_1``, the kept mass ``sigma`` and the bound
  ``theta`` (:mod:`criticalkv.analysis.output_perturbation`, :mod:`criticalkv.analysis.bound`);
* the final-layer hidden-state drift over the answer tokens, decoded through the compressed
  cache versus the full one (:mod:`criticalkv.analysis.drift`).

Decode queries are those of the full model (answer tokens decoded on the uncompressed cache);
their attention ``A`` is the softmax over the prompt keys only, the part of the cache that
compression touches (appended tokens are never evicted).

One JSON line per (sample, method, budget) is appended to ``results.jsonl`` as soon as a sample
is done; a re-run skips what is on disk (:class:`criticalkv.analysis.results_log.ResultsLog`).

The parts: :mod:`~criticalkv.analysis.configs` (what is compared), :mod:`~criticalkv.analysis.run_spec`
(what a folder measures), :mod:`~criticalkv.analysis.measure` (one sample); this module runs them
over the samples of a folder.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from criticalkv.analysis.configs import (
    CRITICAL_PREFIX,
    DEFAULT_BASES,
    DEFAULT_BUDGETS,
    Config,
    check_budgets,
    comparison_configs,
    critical_variant,
)
from criticalkv.analysis.measure import BOUND_ATOL, BOUND_RTOL, measure_sample
from criticalkv.analysis.output_perturbation import DEFAULT_CHUNK_BYTES
from criticalkv.analysis.results_log import RESULTS_FILE, ResultsLog, check_run_config
from criticalkv.analysis.run_spec import RunSpec
from criticalkv.budgets.resolve import Budget
from criticalkv.runs import DEFAULT_WAIT, writer_lock

logger = logging.getLogger(__name__)

__all__ = [
    "BOUND_ATOL",
    "BOUND_RTOL",
    "CRITICAL_PREFIX",
    "DEFAULT_BASES",
    "DEFAULT_BUDGETS",
    "Config",
    "RunOutcome",
    "RunSpec",
    "check_budgets",
    "comparison_configs",
    "critical_variant",
    "measure_sample",
    "run_perturbation",
]


@dataclass(frozen=True)
class RunOutcome:
    """What :func:`run_perturbation` did."""

    measured: int
    skipped: int
    results: Path


def run_perturbation(
    model: Any,
    tokenizer: Any,
    spec: RunSpec,
    out_dir: Path,
    *,
    bases: Sequence[str] = DEFAULT_BASES,
    budgets: Sequence[Budget] = DEFAULT_BUDGETS,
    samples: int = 8,
    command: str | None = None,
    progress: bool = True,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    wait: float = DEFAULT_WAIT,
) -> RunOutcome:
    """Measure ``samples`` needle samples for each base method and its Critical variant.

    Rows go to ``out_dir/results.jsonl`` as each sample finishes; rows already there are
    skipped (a sample whose rows are all done costs nothing). ``out_dir/config.json`` records
    ``spec``, the provenance and ``command``; an existing folder must have the same ``spec``.
    One process writes to a folder at a time: a second waits briefly, then refuses with a sentence.

    Parameters
    ----------
    model, tokenizer : from :func:`criticalkv.load_model`.
    spec : the measurement settings (:class:`RunSpec`).
    out_dir : output folder.
    bases : base methods, each compared with its ``critical-`` variant.
    budgets : entries per KV head: fractions of the prompt or token counts; each must hold the window.
    samples : needle samples ``0 .. samples - 1``.
    command : the command line, recorded in the config file.
    progress : show a progress bar.
    max_chunk_bytes : bound on the large temporaries of the per-layer computation.
    wait : seconds to wait for another process writing to ``out_dir`` before refusing.

    Returns
    -------
    :class:`RunOutcome`.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive integer, not {samples!r}")
    configs = comparison_configs(bases, budgets)
    check_budgets([c.budget for c in configs], spec.length, spec.window)
    out_dir = Path(out_dir)
    with writer_lock(out_dir, wait):  # one writer per folder, as for eval (criticalkv.runs.writer_lock)
        check_run_config(out_dir, spec.to_dict(), command)
        log = ResultsLog(out_dir / RESULTS_FILE)
        done = log.done()
        todo = [[c for c in configs if (i, *c.key) not in done] for i in range(samples)]
        missing = sum(len(t) for t in todo)
        skipped = samples * len(configs) - missing
        if skipped:
            logger.info("%d of %d rows are already in %s; skipping them", skipped, samples * len(configs), log.path)
        bar = tqdm(total=missing, desc="perturbation", unit="row", disable=not progress)
        measured = 0
        try:
            for index, pending in enumerate(todo):
                if not pending:
                    continue
                bar.set_postfix(sample=index)
                rows = measure_sample(model, tokenizer, index, spec, pending, max_chunk_bytes=max_chunk_bytes)
                log.append(rows)
                measured += len(rows)
                bar.update(len(rows))
        finally:
            bar.close()
        return RunOutcome(measured=measured, skipped=skipped, results=log.path)
