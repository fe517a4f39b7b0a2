"""How an engine is started with the plugin, and the check of its configuration (no vLLM import)."""

from __future__ import annotations

from typing import Any

from criticalkv.budgets.resolve import Budget
from criticalkv.cache.prefill import DEFAULT_WINDOW
from criticalkv.vllm.plugin_options import DEFAULT_BUDGET, DEFAULT_VLLM_METHOD, PluginOptions

#: the worker class vLLM is told to use (``--worker-cls``)
WORKER_CLS = "criticalkv.vllm.worker.CriticalKVWorker"

#: engine settings the plugin needs, and why (each refused with its reason when set otherwise)
REQUIRED: dict[str, tuple[Any, str]] = {
    "enable_prefix_caching": (
        False,
        "prefix caching off (--no-enable-prefix-caching): a compressed request's blocks no longer hold "
        "its prompt, so no other request may reuse them",
    ),
    "enforce_eager": (
        True,
        "eager mode (--enforce-eager): the observation window's queries are captured by hooks that a "
        "compiled graph would skip",
    ),
}


def engine_args(
    method: str = DEFAULT_VLLM_METHOD, budget: Budget = DEFAULT_BUDGET, window: int = DEFAULT_WINDOW, **engine: Any
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (or ``AsyncEngineArgs``) that compress every prompt with
    ``method`` at ``budget`` and observation ``window``, plus vLLM's own ``engine`` arguments.

    The options are checked here, before an engine starts (an
    :class:`~criticalkv.options.OptionError` naming the option).
    """
    options = PluginOptions(method, budget, window)
    for name, (value, why) in REQUIRED.items():
        if name in engine and engine[name] != value:
            raise ValueError(f"criticalkv's vLLM plugin needs {why}; do not pass {name}={engine[name]!r}")
    extra = dict(engine.pop("additional_config", None) or {})
    return {
        **engine,
        **{name: value for name, (value, _) in REQUIRED.items()},
        "worker_cls": WORKER_CLS,
        "additional_config": {**extra, **options.as_config()},
    }


def check_engine(vllm_config: Any) -> PluginOptions:
    """The plugin's options from a vLLM engine's configuration, or a ``ValueError`` in one sentence
    naming what to change (its options, or an engine setting the plugin cannot work with)."""
    options = PluginOptions.from_config(vllm_config.additional_config)
    settings = {
        "enable_prefix_caching": bool(vllm_config.cache_config.enable_prefix_caching),
        "enforce_eager": bool(vllm_config.model_config.enforce_eager),
    }
    for name, (value, why) in REQUIRED.items():
        if settings[name] != value:
            raise ValueError(f"criticalkv's vLLM plugin needs {why}")
    device = str(getattr(vllm_config.device_config, "device_type", "cpu"))
    if device != "cpu":
        raise ValueError(
            f"criticalkv's vLLM plugin runs on vLLM's CPU attention backend only, not on {device} "
            "(docs/vllm.md, Limits)"
        )
    if str(vllm_config.cache_config.cache_dtype) != "auto":
        raise ValueError("criticalkv's vLLM plugin stores the model's dtype: start without --kv-cache-dtype")
    if vllm_config.speculative_config is not None:
        raise ValueError("criticalkv's vLLM plugin does not run with speculative decoding; start without it")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "criticalkv's vLLM plugin runs one worker (tensor and pipeline parallel size 1): it reads each "
            "layer's whole output projection"
        )
    return options
