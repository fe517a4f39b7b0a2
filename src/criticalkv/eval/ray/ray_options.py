"""How a sweep runs on Ray (:class:`RayOptions`), and importing ``ray`` with a useful error."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType


class RayNotInstalled(ImportError):
    """``ray`` is not importable; the message says how to install it."""


def import_ray() -> ModuleType:
    """The ``ray`` module, or :class:`RayNotInstalled` with the install command."""
    try:
        import ray
    except ImportError as error:
        raise RayNotInstalled(
            "running a sweep on Ray needs the ray package: pip install -e '.[ray]' in a clone "
            "(or pip install 'ray>=2.9')"
        ) from error
    return ray


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
