"""Performance benchmarks: prefill, compression, time to first token, decode latency, memory.

``criticalkv bench`` (and :func:`run_bench`) measure our methods side by side with the full
cache and, when the optional ``kvpress`` package is importable, with kvpress's equivalents,
in one process.
"""

from criticalkv.bench.record import BenchRecord
from criticalkv.bench.runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "BenchRecord", "run_bench"]
