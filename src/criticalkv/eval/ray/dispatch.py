"""The driver side of a Ray sweep: a pool of workers kept busy, records appended as units return,
the units of dead workers retried on fresh ones."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from tqdm.auto import tqdm

from criticalkv.eval.ray.ray_options import RayOptions
from criticalkv.eval.ray.worker import UnitResult, WorkUnit
from criticalkv.eval.results import append_result, append_skipped, content_hash, is_done, result_key

logger = logging.getLogger(__name__)

#: units queued on each worker at a time (one running, one waiting: no idle gap between units)
UNITS_PER_WORKER = 2


def lost_worker_errors(ray: ModuleType) -> tuple[type[BaseException], ...]:
    """The errors of ``ray.get`` that mean the worker (not the work) failed."""
    errors = ray.exceptions
    return (errors.RayActorError, errors.WorkerCrashedError, errors.ObjectLostError, errors.OutOfMemoryError)


def ray_get(ray: ModuleType, refs: Any) -> Any:
    """``ray.get``, re-raising an error a worker's code raised (e.g. a ``ValueError``) as itself."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None)
        if not isinstance(cause, Exception) or isinstance(cause, ray.exceptions.RayError):
            raise
        logger.debug("a Ray worker raised:\n%s", error)
        raise cause from None


class WorkerPool:
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


class _Dispatcher:
    """One sweep's queue of units over a :class:`WorkerPool` (see :func:`dispatch`)."""

    def __init__(
        self,
        ray: ModuleType,
        pool: WorkerPool,
        units: list[WorkUnit],
        out: Path,
        done: dict[str, str | None],
        options: RayOptions,
    ) -> None:
        self.ray, self.pool, self.out, self.done, self.options = ray, pool, out, done, options
        self.queue: deque[tuple[WorkUnit, int]] = deque((unit, 1) for unit in units)
        self.inflight: dict[Any, tuple[int, Any, WorkUnit, int]] = {}  # ref -> (slot, worker, unit, attempt)
        self.lost = lost_worker_errors(ray)
        self.unit_seconds: list[float] = []
        self.setup_deaths = 0
        self.bar: Any = None

    def fill(self, slot: int) -> None:
        """Queue units on the worker of ``slot`` up to :data:`UNITS_PER_WORKER`, once it is ready."""
        worker = self.pool.workers[slot]
        load = sum(1 for _, w, _, _ in self.inflight.values() if w is worker)
        while self.pool.ready[slot] and self.queue and load < UNITS_PER_WORKER:
            unit, attempt = self.queue.popleft()
            self.inflight[worker.run.remote(unit)] = (slot, worker, unit, attempt)
            load += 1

    def on_setup(self, ref: Any) -> None:
        """A worker finished loading its model (or died trying)."""
        slot, worker = self.pool.setups.pop(ref)
        try:
            info = ray_get(self.ray, ref)
        except self.lost as error:
            self.setup_deaths += 1
            if self.setup_deaths > self.options.max_unit_attempts * len(self.pool.workers):
                raise RuntimeError(f"Ray workers keep dying while they load the model ({error})") from error
            logger.warning("a worker died loading the model (%s); starting a fresh one", error)
            if self.pool.workers[slot] is worker:
                self.pool.replace(slot)
            return
        if self.pool.workers[slot] is worker:
            self.pool.ready[slot] = True
            logger.info("worker ready: %s", info)
            self.fill(slot)

    def on_unit(self, ref: Any) -> None:
        """A unit came back: append its new records, or requeue it if its worker died."""
        slot, worker, unit, attempt = self.inflight.pop(ref)
        try:
            result: UnitResult = ray_get(self.ray, ref)
        except self.lost as error:
            if attempt >= self.options.max_unit_attempts:
                raise RuntimeError(
                    f"unit {unit.describe()} failed {attempt} times because its worker died ({error}); "
                    "what finished is saved, run the same command again to resume"
                ) from error
            logger.warning("a worker died running %s (%s); retrying on a fresh worker", unit.describe(), error)
            if self.pool.workers[slot] is worker:  # replace it once, however many of its units fail
                self.pool.replace(slot)
            self.queue.appendleft((unit, attempt + 1))
            return
        self.unit_seconds.append(result.seconds)
        for skip in result.skipped:
            append_skipped(self.out, skip)
        self.write(result.records)

    def write(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            key, sha = result_key(record), content_hash(record)
            if is_done(self.done, key, sha):  # a retried unit recomputed it
                logger.debug("dropping a duplicate result %s", key)
                continue
            append_result(self.out, record)
            self.done[key] = sha
            self.bar.update(1)

    def run(self, already: int) -> None:
        total = already + sum(unit.num_records for unit, _ in self.queue)
        self.bar = tqdm(total=total, initial=already, desc="eval (ray)", unit="run")
        try:
            while self.queue or self.inflight:
                ready, _ = self.ray.wait([*self.inflight, *self.pool.setups], num_returns=1)
                if ready[0] in self.pool.setups:
                    self.on_setup(ready[0])
                    continue
                self.on_unit(ready[0])
                for slot in range(len(self.pool.workers)):
                    self.fill(slot)
        finally:
            self.bar.close()


def dispatch(
    ray: ModuleType,
    pool: WorkerPool,
    units: list[WorkUnit],
    out: Path,
    done: dict[str, str | None],
    already: int,
    options: RayOptions,
) -> None:
    """Keep every ready worker busy, append the records as units return, retry the units of dead workers."""
    started = time.perf_counter()
    dispatcher = _Dispatcher(ray, pool, units, out, done, options)
    dispatcher.run(already)
    wall = time.perf_counter() - started
    seconds = dispatcher.unit_seconds
    logger.info(
        "%d units on %d workers in %.1f s (%.2f s per unit on a worker, %.2f s per unit of wall time)",
        len(units),
        len(pool.workers),
        wall,
        sum(seconds) / len(seconds) if seconds else 0.0,
        wall / max(len(units), 1),
    )
