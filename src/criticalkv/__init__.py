"""criticalkv: KV-cache eviction by output perturbation (CriticalKV), with a physically
compressed, head-varying cache for transformers."""

from criticalkv.budgets.resolve import parse_budget, resolve_budget
from criticalkv.cache import CacheSpec, CaptureCache, CompressedCache, DecodeBudget
from criticalkv.methods import Method, available_methods, bind, get_method, register
from criticalkv.models import load_model
from criticalkv.needs import Needs
from criticalkv.runtime import GenerationResult, attach, compress_prompt, continue_generation, generate, prefill
from criticalkv.state import LayerState

__version__ = "0.1.0"

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
