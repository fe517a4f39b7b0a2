"""A benchmark script must not shadow an installed module.

``python benchmarks/x.py`` puts ``benchmarks/`` first on ``sys.path``: a script named like an
installed package (``kernels.py`` beside the ``kernels`` package transformers probes) is imported
in its place and breaks the run (CI failed that way once).
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def installed_module_names() -> set[str]:
    """Top-level import names of every installed distribution, and the standard library's."""
    names = set(importlib.metadata.packages_distributions())
    return names | set(sys.stdlib_module_names)


def test_no_benchmark_script_shadows_an_installed_module() -> None:
    scripts = {path.stem for path in BENCHMARKS.glob("*.py")}
    assert scripts, "no benchmark scripts found"
    clashes = sorted(scripts & installed_module_names())
    assert not clashes, f"benchmarks/ scripts shadow installed modules: {clashes}; rename them"
