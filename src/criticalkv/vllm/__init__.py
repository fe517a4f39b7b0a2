"""CriticalKV inside vLLM: each request's prompt KV is compressed once its prefill completes, the
kept entries move into the request's first blocks, and the blocks after them go back to vLLM's pool.

Start an engine with :func:`engine_args` (``vllm.LLM(**engine_args(model=FOLDER, method=..., budget=...))``)
or ``python -m criticalkv.vllm serve FOLDER --method ... --budget ...`` (docs/vllm.md). The parts:
:mod:`.options` (what to compress with, checked once), :mod:`.engine` (the engine's settings),
:mod:`.paged` (moving entries in the paged cache), :mod:`.compressor` and :mod:`.runner` (the worker's
steps), :mod:`.blocks` (the scheduler frees the blocks) and :mod:`.worker` (what vLLM is told to run).
Only :mod:`.options`, :mod:`.engine` and :mod:`.paged` import without vLLM installed.
"""

from __future__ import annotations

from criticalkv.vllm.engine import WORKER_CLS, check_engine, engine_args
from criticalkv.vllm.plugin_options import (
    DEFAULT_VLLM_METHOD,
    PluginOptions,
    freed_blocks,
    kept_entries,
    supported_methods,
    unsupported_reason,
)

__all__ = [
    "DEFAULT_VLLM_METHOD",
    "WORKER_CLS",
    "PluginOptions",
    "check_engine",
    "engine_args",
    "freed_blocks",
    "kept_entries",
    "supported_methods",
    "unsupported_reason",
]
