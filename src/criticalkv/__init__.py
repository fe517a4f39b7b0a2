"""criticalkv: KV-cache eviction by output perturbation (CriticalKV), with a physically
compressed, head-varying cache for transformers.

The public names below are imported on first use (PEP 562), so importing ``criticalkv`` (or the
``criticalkv`` command, for ``--help``) does not load torch or transformers until they are needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from criticalkv.budgets.resolve import parse_budget, resolve_budget
    from criticalkv.cache import CacheSpec, CaptureCache, CompressedCache, DecodeBudget
    from criticalkv.methods import Method, available_methods, bind, get_method, register
    from criticalkv.models import load_model
    from criticalkv.needs import Needs
    from criticalkv.runtime import compress_prompt, continue_generation, prefill
    from criticalkv.runtime.attach import attach
    from criticalkv.runtime.generate import GenerationResult, generate
    from criticalkv.state import LayerState

__version__ = "0.1.0"

#: each public name and the module it comes from
_HOMES: dict[str, str] = {
    **dict.fromkeys(["parse_budget", "resolve_budget"], "criticalkv.budgets.resolve"),
    **dict.fromkeys(["CacheSpec", "CaptureCache", "CompressedCache", "DecodeBudget"], "criticalkv.cache"),
    **dict.fromkeys(["Method", "available_methods", "bind", "get_method", "register"], "criticalkv.methods"),
    "load_model": "criticalkv.models",
    "Needs": "criticalkv.needs",
    **dict.fromkeys(
        ["GenerationResult", "attach", "compress_prompt", "continue_generation", "generate", "prefill"],
        "criticalkv.runtime",
    ),
    "LayerState": "criticalkv.state",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then cached as a module attribute)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'criticalkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = [
    "CacheSpec",
    "CaptureCache",
    "CompressedCache",
    "DecodeBudget",
    "GenerationResult",
    "LayerState",
    "Method",
    "Needs",
    "__version__",
    "attach",
    "available_methods",
    "bind",
    "compress_prompt",
    "continue_generation",
    "generate",
    "get_method",
    "load_model",
    "parse_budget",
    "prefill",
    "register",
    "resolve_budget",
]
