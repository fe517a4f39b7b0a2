"""The sweep on a Ray cluster (``criticalkv scale`` / ``criticalkv eval --ray``, docs/ray.md):
work units, the workers that run them and the dispatch that records their results.

``ray`` itself (the ``[ray]`` extra) is imported only when a sweep starts (:class:`RayNotInstalled`
without it). Code outside ``eval/`` imports these names from here.
"""

from __future__ import annotations

from criticalkv.eval.ray.dispatch import WorkerPool, dispatch
from criticalkv.eval.ray.ray_options import RayNotInstalled, RayOptions, import_ray
from criticalkv.eval.ray.runner import run_sweep_ray
from criticalkv.eval.ray.worker import EvalWorker, SampleHook, UnitResult, WorkUnit, build_units

__all__ = [
    "EvalWorker",
    "RayNotInstalled",
    "RayOptions",
    "SampleHook",
    "UnitResult",
    "WorkUnit",
    "WorkerPool",
    "build_units",
    "dispatch",
    "import_ray",
    "run_sweep_ray",
]
