"""Sweeps on a Ray cluster: (sample group, model) work units on actors that load their model once.

The driver (the process that calls :func:`run_sweep_ray`) builds the samples itself (it needs
only the tokenizer, see :func:`criticalkv.models.load_tokenizer`) and ships them inside the
units, so workers need no access to data files, QA sources or dataset downloads, and every
benchmark the local runner knows runs here unchanged. Each worker
(:class:`~criticalkv.eval.ray.worker.EvalWorker`) loads the sweep's model once and evaluates the
units sent to it with the same :class:`~criticalkv.eval.sweep.unit.SampleEvaluator` as the local
runner, then returns the records.

The driver is the only writer of ``results.jsonl`` (:mod:`criticalkv.eval.ray.dispatch`): it
appends each returned record whose key is not yet there, so a unit recomputed after a worker
died is written exactly once, and a folder resumes across the local and Ray paths alike. A dead
worker is restarted by Ray (``max_restarts``/``max_task_retries``); a unit whose worker is gone
for good goes to a fresh worker, up to ``max_unit_attempts`` times.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

from criticalkv.eval.ray.dispatch import WorkerPool, dispatch
from criticalkv.eval.ray.ray_options import RayNotInstalled, RayOptions, import_ray
from criticalkv.eval.ray.worker import EvalWorker, SampleHook, UnitResult, WorkUnit, build_units
from criticalkv.eval.results import done_index
from criticalkv.eval.sweep.config import SweepConfig
from criticalkv.eval.sweep.folder_hold import record_unusable, sweep_folder
from criticalkv.runs import DEFAULT_WAIT

logger = logging.getLogger(__name__)

__all__ = [
    "EvalWorker",
    "RayNotInstalled",
    "RayOptions",
    "UnitResult",
    "WorkUnit",
    "build_units",
    "import_ray",
    "run_sweep_ray",
]


def _num_workers(ray: ModuleType, options: RayOptions, num_units: int) -> int:
    if options.workers is not None:
        return min(options.workers, num_units)
    resources = ray.cluster_resources()
    fits = []
    if options.cpus_per_worker > 0:
        fits.append(int(resources.get("CPU", 0) // options.cpus_per_worker))
    if options.gpus_per_worker > 0:
        fits.append(int(resources.get("GPU", 0) // options.gpus_per_worker))
    count = min(fits)
    if count < 1:
        raise ValueError(
            f"the Ray cluster has {resources.get('CPU', 0):g} CPUs and {resources.get('GPU', 0):g} GPUs, too few "
            f"for one worker ({options.cpus_per_worker:g} CPUs, {options.gpus_per_worker:g} GPUs); lower "
            "--ray-cpus-per-worker / --ray-gpus-per-worker, or pass --ray-workers on an autoscaling cluster"
        )
    return min(count, num_units)


def _run_units(
    ray: ModuleType,
    config: SweepConfig,
    options: RayOptions,
    after_sample: SampleHook | None,
    units: list[WorkUnit],
    out: Path,
    done: dict[str, str | None],
    already: int,
) -> None:
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address=options.address)
    elif options.address:
        logger.warning("Ray is already initialised; ignoring address %s", options.address)
    pool: WorkerPool | None = None
    try:
        remote = ray.remote(EvalWorker).options(
            num_cpus=options.cpus_per_worker,
            num_gpus=options.gpus_per_worker,
            max_restarts=options.max_restarts,
            max_task_retries=options.max_restarts,
        )
        count = _num_workers(ray, options, len(units))
        logger.info("starting %d Ray workers for %d units of %s", count, len(units), config.model)
        pool = WorkerPool(ray, lambda: remote.remote(config, options, after_sample), count)
        dispatch(ray, pool, units, out, done, already, options)
    finally:
        if pool is not None:
            pool.close()
        if owns_ray:
            ray.shutdown()


def run_sweep_ray(
    config: SweepConfig,
    options: RayOptions | None = None,
    *,
    after_sample: SampleHook | None = None,
    wait: float = DEFAULT_WAIT,
) -> Path:
    """Run (or resume) a sweep on Ray; results go to ``config.out/results.jsonl`` as with
    :func:`~criticalkv.eval.sweep.runner.run_sweep` (same records, same keys).

    ``after_sample`` is called on the worker after each sample it evaluates (it travels to the
    workers, so it must pickle). The driver holds the folder's writer lock for the whole run
    (``wait`` as in :func:`~criticalkv.eval.sweep.runner.run_sweep`).
    """
    ray = import_ray()
    from criticalkv.models import load_tokenizer

    options = options or RayOptions()
    tokenizer = load_tokenizer(config.model)
    with sweep_folder(Path(config.out), config.identity(), {**config.to_json(), "ray": asdict(options)}, wait) as out:
        done = done_index(out)
        record_unusable(out, config)
        units, already = build_units(config, tokenizer, done, options.samples_per_unit)
        if not units:
            logger.info("nothing left to run in %s", out)
            return out
        _run_units(ray, config, options, after_sample, units, out, done, already)
    return out
