"""The benchmarks a sweep can run, by name: ``ruler``, ``longbench`` and ``dataset``.

A benchmark (:class:`~criticalkv.eval.benchmarks.base.Benchmark`) has its own options
dataclass, checks them, makes the samples and says what it adds to the run identity; the
sweep (:class:`~criticalkv.eval.sweep.config.SweepConfig`) looks it up here by name.
"""

from __future__ import annotations

from criticalkv.eval.benchmarks.base import FLAT_DEFAULTS, Benchmark, Draw
from criticalkv.eval.benchmarks.dataset import Dataset, DatasetOptions
from criticalkv.eval.benchmarks.longbench import LongBench, LongBenchOptions
from criticalkv.eval.benchmarks.ruler import Ruler, RulerOptions

BENCHMARKS: dict[str, Benchmark] = {}


def register_benchmark(benchmark: Benchmark) -> Benchmark:
    """Make ``benchmark`` available by its name (replacing one of the same name)."""
    BENCHMARKS[benchmark.name] = benchmark
    return benchmark


def get_benchmark(name: str) -> Benchmark:
    """The registered benchmark called ``name``; ``ValueError`` naming the choices otherwise."""
    if name not in BENCHMARKS:
        names = [repr(n) for n in BENCHMARKS]
        choices = " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]
        raise ValueError(f"benchmark must be {choices} (or use --dataset), not {name!r}")
    return BENCHMARKS[name]


for _benchmark in (Ruler(), LongBench(), Dataset()):
    register_benchmark(_benchmark)

__all__ = [
    "BENCHMARKS",
    "FLAT_DEFAULTS",
    "Benchmark",
    "Dataset",
    "DatasetOptions",
    "Draw",
    "LongBench",
    "LongBenchOptions",
    "Ruler",
    "RulerOptions",
    "get_benchmark",
    "register_benchmark",
]
