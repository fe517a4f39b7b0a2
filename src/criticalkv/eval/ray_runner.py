"""Sweeps on a Ray cluster: (sample group, model) work units on actors that load their model once.

The driver (the process that calls :func:`run_sweep_ray`) builds the samples itself (it needs
only the tokenizer, see :func:`criticalkv.models.load_tokenizer`) and ships them inside the
units, so workers need no access to data files, QA sources or dataset downloads, and every
benchmark the local runner knows runs here unchanged. Each worker (:class:`EvalWorker`) loads
the sweep's model once and evaluates the units sent to it with the same
:class:`~criticalkv.eval.unit.SampleEvaluator` as the local runner, then returns the records.

The driver is the only writer of ``results.jsonl``: it appends each returned record whose key
is not yet there, so a unit recomputed after a worker died is written exactly once, and a
folder resumes across the local and Ray paths alike. A dead worker is restarted by Ray
(``max_restarts``/``max_task_retries``); a unit whose worker is gone for good goes to a fresh
worker, up to ``max_unit_attempts`` times.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tqdm.auto import tqdm

from criticalkv.eval.runner import SweepConfig, _samples
from criticalkv.eval.store import append_result, iter_done, open_run, result_key
from criticalkv.eval.unit import SampleEvaluator, UnitItem, pending_pairs

logger = logging.getLogger(__name__)

#: test hook: the first worker that removes this file exits at once, in the middle of a unit
CRASH_FILE_ENV = "CRITICALKV_TEST_CRASH_FILE"
#: units queued on each worker at a time (one running, one waiting: no idle gap between units)
UNITS_PER_WORKER = 2


class RayNotInstalled(ImportError):
    """``ray`` is not importable; the message says how to install it."""


def import_ray() -> ModuleType:
    """The ``ray`` module, or :class:`RayNotInstalled` with the install command."""
    try:
        import ray
    except ImportError as error:
        raise RayNotInstalled(
            "running a sweep on Ray needs the ray package: pip install 'criticalkv[ray]' (or pip install 'ray>=2.9')"
        ) from error
    return ray


@dataclass(frozen=True)
class WorkUnit:
    """A group of samples evaluated in a row by one worker on its loaded ``model``."""

    model: str
    items: tuple[UnitItem, ...]

    @property
    def num_records(self) -> int:
        return sum(item.num_records for item in self.items)

    def describe(self) -> str:
        first = self.items[0]
        return f"{self.model}: {len(self.items)} sample(s) from {first.sample.task}|{first.length}|{first.sample.index}"


@dataclass(frozen=True)
class UnitResult:
    """What a worker returns for a unit: the records and how long the unit took there."""

    records: list[dict[str, Any]]
    seconds: float
    worker: str


@dataclass(frozen=True)
class RayOptions:
    """How a sweep runs on Ray.

    Parameters
    ----------
    address : the cluster to join (``"auto"``, ``"ray://head:10001"``, ``"host:6379"``); ``None``:
        ``$RAY_ADDRESS`` or a new local cluster. Ignored if Ray is already initialised.
    cpus_per_worker, gpus_per_worker : Ray resources of each worker (actor). With several GPUs
        and ``device_map="auto"`` a worker shards its model across them.
    workers : how many workers to start; default as many as the cluster's resources fit (at most
        one per unit).
    samples_per_unit : samples in one work unit (the granularity of scheduling and of retries).
    device, dtype, device_map : passed to :func:`criticalkv.models.load_model` on each worker.
    max_restarts : Ray restarts a dead worker (it reloads its model) and retries its units this often.
    max_unit_attempts : a unit whose worker is gone for good is sent to a fresh worker, up to this
        many attempts in all.
    """

    address: str | None = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    workers: int | None = None
    samples_per_unit: int = 1
    device: str | None = None
    dtype: str | None = None
    device_map: str | None = None
    max_restarts: int = 2
    max_unit_attempts: int = 3

    def __post_init__(self) -> None:
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise ValueError("--ray-cpus-per-worker and --ray-gpus-per-worker must not be negative")
        if self.cpus_per_worker == 0 and self.gpus_per_worker == 0:
            raise ValueError("a Ray worker needs CPUs or GPUs; raise --ray-cpus-per-worker or --ray-gpus-per-worker")
        if self.workers is not None and self.workers < 1:
            raise ValueError("--ray-workers must be at least 1")
        if self.samples_per_unit < 1:
            raise ValueError("--ray-samples-per-unit must be at least 1")
        if self.max_restarts < 0 or self.max_unit_attempts < 1:
            raise ValueError("max_restarts must be >= 0 and max_unit_attempts >= 1")
        if self.device is not None and self.device_map is not None:
            raise ValueError("pass either --device or --device-map, not both")


def _maybe_crash() -> None:
    """Test hook (see :data:`CRASH_FILE_ENV`): exit the worker process as if it were killed."""
    path = os.environ.get(CRASH_FILE_ENV)
    if not path:
        return
    try:
        os.remove(path)  # only one worker wins
    except FileNotFoundError:
        return
    logger.warning("test hook %s: this worker exits now", CRASH_FILE_ENV)
    os._exit(1)


class EvalWorker:
    """A Ray actor: loads the sweep's model once, then evaluates the units sent to it."""

    def __init__(self, config: SweepConfig, options: RayOptions) -> None:
        self.config = config
        self.options = options
        self.evaluator: SampleEvaluator | None = None
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def setup(self) -> dict[str, Any]:
        """Load the model (once); returns where it lives and how long loading took."""
        from criticalkv.models import load_model

        started = time.perf_counter()
        if self.evaluator is None:
            torch.set_num_threads(max(1, int(self.options.cpus_per_worker)))
            model, tokenizer = load_model(
                self.config.model,
                device=self.options.device,
                dtype=self.options.dtype,
                device_map=self.options.device_map,
            )
            self.evaluator = SampleEvaluator(self.config, model, tokenizer)
            logger.info("worker %s loaded %s", self.name, self.config.model)
        model = self.evaluator.model
        return {
            "worker": self.name,
            "device": str(self.evaluator.device),
            "device_map": getattr(model, "hf_device_map", None),
            "load_s": time.perf_counter() - started,
        }

    def run(self, unit: WorkUnit) -> UnitResult:
        """Evaluate every sample of ``unit``; the records come back together at the end."""
        if self.evaluator is None:
            self.setup()
        assert self.evaluator is not None
        started = time.perf_counter()
        records: list[dict[str, Any]] = []
        for item in unit.items:
            records += self.evaluator.run(item.length, item.sample, item.pending)
            _maybe_crash()
        return UnitResult(records, time.perf_counter() - started, self.name)


def build_units(
    config: SweepConfig, tokenizer: Any, done: Container[str], samples_per_unit: int
) -> tuple[list[WorkUnit], int]:
    """The sweep's pending work as units of ``samples_per_unit`` samples (in the local runner's
    order), and how many of the sweep's results are already done."""
    pairs = config.configs()
    units: list[WorkUnit] = []
    group: list[UnitItem] = []
    already = 0
    for length, sample in _samples(config, tokenizer):
        pending = pending_pairs(sample, length, pairs, done)
        already += len(pairs) - len(pending)
        if pending:
            group.append(UnitItem(length, sample, tuple(pending)))
        if len(group) == samples_per_unit:
            units.append(WorkUnit(config.model, tuple(group)))
            group = []
    if group:
        units.append(WorkUnit(config.model, tuple(group)))
    return units, already


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


def _lost_worker_errors(ray: ModuleType) -> tuple[type[BaseException], ...]:
    errors = ray.exceptions
    return (errors.RayActorError, errors.WorkerCrashedError, errors.ObjectLostError, errors.OutOfMemoryError)


def _get(ray: ModuleType, refs: Any) -> Any:
    """``ray.get``, re-raising an error a worker's code raised (e.g. a ``ValueError``) as itself."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None)
        if not isinstance(cause, Exception) or isinstance(cause, ray.exceptions.RayError):
            raise
        logger.debug("a Ray worker raised:\n%s", error)
        raise cause from None


def run_sweep_ray(config: SweepConfig, options: RayOptions | None = None) -> Path:
    """Run (or resume) a sweep on Ray; results go to ``config.out/results.jsonl`` as with
    :func:`~criticalkv.eval.runner.run_sweep` (same records, same keys)."""
    ray = import_ray()
    from criticalkv.models import load_tokenizer

    options = options or RayOptions()
    out = Path(config.out)
    open_run(out, config.identity(), {**config.to_json(), "ray": asdict(options)})
    done = set(iter_done(out))
    units, already = build_units(config, load_tokenizer(config.model), done, options.samples_per_unit)
    if not units:
        logger.info("nothing left to run in %s", out)
        return out
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address=options.address)
    elif options.address:
        logger.warning("Ray is already initialised; ignoring address %s", options.address)
    pool: _Pool | None = None
    try:
        remote = ray.remote(EvalWorker).options(
            num_cpus=options.cpus_per_worker,
            num_gpus=options.gpus_per_worker,
            max_restarts=options.max_restarts,
            max_task_retries=options.max_restarts,
        )
        count = _num_workers(ray, options, len(units))
        logger.info("starting %d Ray workers for %d units of %s", count, len(units), config.model)
        pool = _Pool(ray, lambda: remote.remote(config, options), count)
        _dispatch(ray, pool, units, out, done, already, options)
    finally:
        if pool is not None:
            pool.close()
        if owns_ray:
            ray.shutdown()
    return out


class _Pool:
    """The sweep's workers, by slot. A slot takes units only once its worker has loaded the model,
    so units never wait on a worker the cluster cannot place yet (e.g. drivers sharing a cluster)."""

    def __init__(self, ray: ModuleType, spawn: Callable[[], Any], count: int) -> None:
        self.ray = ray
        self.spawn = spawn
        self.workers: list[Any] = [None] * count
        self.ready = [False] * count
        self.setups: dict[Any, tuple[int, Any]] = {}  # setup ref -> (slot, worker)
        for slot in range(count):
            self.replace(slot)

    def replace(self, slot: int) -> None:
        """Start a fresh worker in ``slot`` (killing the old one for good)."""
        if self.workers[slot] is not None:
            self.ray.kill(self.workers[slot], no_restart=True)
        worker = self.spawn()
        self.workers[slot] = worker
        self.ready[slot] = False
        self.setups[worker.setup.remote()] = (slot, worker)

    def close(self) -> None:
        for worker in self.workers:
            self.ray.kill(worker, no_restart=True)


def _dispatch(
    ray: ModuleType,
    pool: _Pool,
    units: list[WorkUnit],
    out: Path,
    done: set[str],
    already: int,
    options: RayOptions,
) -> None:
    """Keep every ready worker busy, append the records as units return, retry the units of dead workers."""
    queue: deque[tuple[WorkUnit, int]] = deque((unit, 1) for unit in units)
    inflight: dict[Any, tuple[int, Any, WorkUnit, int]] = {}  # ref -> (slot, worker, unit, attempt)
    lost = _lost_worker_errors(ray)
    bar = tqdm(total=already + sum(u.num_records for u in units), initial=already, desc="eval (ray)", unit="run")
    started = time.perf_counter()
    unit_seconds: list[float] = []
    setup_deaths = 0

    def fill(slot: int) -> None:
        worker = pool.workers[slot]
        load = sum(1 for _, w, _, _ in inflight.values() if w is worker)
        while pool.ready[slot] and queue and load < UNITS_PER_WORKER:
            unit, attempt = queue.popleft()
            inflight[worker.run.remote(unit)] = (slot, worker, unit, attempt)
            load += 1

    try:
        while queue or inflight:
            ready, _ = ray.wait([*inflight, *pool.setups], num_returns=1)
            ref = ready[0]
            if ref in pool.setups:
                slot, worker = pool.setups.pop(ref)
                try:
                    info = _get(ray, ref)
                except lost as error:
                    setup_deaths += 1
                    if setup_deaths > options.max_unit_attempts * len(pool.workers):
                        raise RuntimeError(f"Ray workers keep dying while they load the model ({error})") from error
                    logger.warning("a worker died loading the model (%s); starting a fresh one", error)
                    if pool.workers[slot] is worker:
                        pool.replace(slot)
                    continue
                if pool.workers[slot] is worker:
                    pool.ready[slot] = True
                    logger.info("worker ready: %s", info)
                    fill(slot)
                continue
            slot, worker, unit, attempt = inflight.pop(ref)
            try:
                result: UnitResult = _get(ray, ref)
            except lost as error:
                if attempt >= options.max_unit_attempts:
                    raise RuntimeError(
                        f"unit {unit.describe()} failed {attempt} times because its worker died ({error}); "
                        "what finished is saved, run the same command again to resume"
                    ) from error
                logger.warning("a worker died running %s (%s); retrying on a fresh worker", unit.describe(), error)
                if pool.workers[slot] is worker:  # replace it once, however many of its units fail
                    pool.replace(slot)
                queue.appendleft((unit, attempt + 1))
            else:
                unit_seconds.append(result.seconds)
                for record in result.records:
                    key = result_key(record)
                    if key in done:  # a retried unit recomputed it
                        logger.debug("dropping a duplicate result %s", key)
                        continue
                    append_result(out, record)
                    done.add(key)
                    bar.update(1)
            for other in range(len(pool.workers)):
                fill(other)
    finally:
        bar.close()
    wall = time.perf_counter() - started
    mean = sum(unit_seconds) / len(unit_seconds) if unit_seconds else 0.0
    logger.info(
        "%d units on %d workers in %.1f s (%.2f s per unit on a worker, %.2f s per unit of wall time)",
        len(units),
        len(pool.workers),
        wall,
        mean,
        wall / max(len(units), 1),
    )
