"""The plugin's options, engine settings and block arithmetic (no vLLM needed)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from criticalkv.options import OptionError, OptionTypeError
from criticalkv.vllm import (
    DEFAULT_VLLM_METHOD,
    WORKER_CLS,
    PluginOptions,
    check_engine,
    engine_args,
    freed_blocks,
    kept_entries,
    supported_methods,
)


def test_the_supported_methods_are_the_uniform_window_methods() -> None:
    assert supported_methods() == [
        "full",
        "snapkv",
        "critical-snapkv",
        "streamingllm",
        "knorm",
        "tova",
        "critical-tova",
        "keydiff",
    ]
    assert DEFAULT_VLLM_METHOD in supported_methods()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "adakv"}, "'adakv' cannot run inside vLLM: its budgets vary over KV heads or layers"),
        ({"method": "layer-defensivekv"}, "its budgets vary over KV heads or layers"),
        ({"method": "h2o"}, "its scores read prompt queries beyond the observation window"),
        ({"method": "nope"}, "nope"),
        ({"budget": 0}, "budget 0 tokens is below 1"),
        ({"budget": 1.5}, "budget 1.5 is not a fraction in (0, 1]"),
        ({"window": 0}, "window must be a positive integer"),
        ({"window": 1.5}, "window must be a positive integer"),
    ],
)
def test_a_wrong_option_is_one_sentence_before_any_engine(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        engine_args(model="m", **options)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_booleans_are_not_budgets() -> None:
    with pytest.raises(OptionTypeError, match="budget"):
        PluginOptions("snapkv", True)  # type: ignore[arg-type]


def test_engine_args_name_the_worker_and_carry_the_options() -> None:
    args = engine_args(model="m", method="snapkv", budget=0.1, window=16, dtype="float32", additional_config={"x": 1})
    assert args["worker_cls"] == WORKER_CLS
    assert args["enable_prefix_caching"] is False and args["enforce_eager"] is True
    assert args["additional_config"] == {"x": 1, "criticalkv": {"method": "snapkv", "budget": 0.1, "window": 16}}
    assert args["model"] == "m" and args["dtype"] == "float32"
    assert PluginOptions.from_config(args["additional_config"]) == PluginOptions("snapkv", 0.1, 16)


def test_engine_args_refuse_settings_the_plugin_cannot_run_with() -> None:
    with pytest.raises(ValueError, match="prefix caching off"):
        engine_args(model="m", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="eager mode"):
        engine_args(model="m", enforce_eager=False)


def test_the_defaults_are_the_plugins_and_the_librarys() -> None:
    assert PluginOptions.from_config(None) == PluginOptions("critical-snapkv", 0.2, 32)
    assert PluginOptions.from_config({"criticalkv": '{"budget": 0.1}'}).budget == 0.1


def test_unknown_keys_and_wrong_types_in_additional_config_are_refused() -> None:
    with pytest.raises(OptionError, match="has no option 'budgte'; its options: method, budget, window"):
        PluginOptions.from_config({"criticalkv": {"budgte": 0.2}})
    with pytest.raises(OptionTypeError, match="must be a mapping"):
        PluginOptions.from_config({"criticalkv": [0.2]})


def _config(**changes: Any) -> Any:
    config = SimpleNamespace(
        additional_config={"criticalkv": {"method": "snapkv"}},
        cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"),
        device_config=SimpleNamespace(device_type="cpu"),
        model_config=SimpleNamespace(enforce_eager=True),
        speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    for path, value in changes.items():
        owner, _, name = path.rpartition("__")
        setattr(getattr(config, owner) if owner else config, name, value)
    return config


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cache_config__enable_prefix_caching": True}, "needs prefix caching off (--no-enable-prefix-caching)"),
        ({"model_config__enforce_eager": False}, "needs eager mode (--enforce-eager)"),
        ({"speculative_config": object()}, "does not run with speculative decoding"),
        ({"device_config__device_type": "cuda"}, "CPU attention backend only, not on cuda"),
        ({"cache_config__cache_dtype": "fp8"}, "start without --kv-cache-dtype"),
        ({"parallel_config__tensor_parallel_size": 2}, "tensor and pipeline parallel size 1"),
    ],
)
def test_the_worker_refuses_an_engine_it_cannot_run_in(changes: dict[str, Any], message: str) -> None:
    assert check_engine(_config()) == PluginOptions("snapkv")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_engine(_config(**changes))


def test_short_prompts_stay_whole() -> None:
    spec = PluginOptions("snapkv", 0.2, 32).spec()
    assert kept_entries(spec, 100) == 100  # 0.2 * 100 = 20 entries cannot hold the 32-token window
    assert kept_entries(spec, 160) == 32
    assert kept_entries(PluginOptions("snapkv", 512).spec(), 400) == 400  # more tokens than the prompt
    assert kept_entries(PluginOptions("full").spec(), 4000) == 4000


@given(
    prompt=st.integers(1, 20_000),
    share=st.floats(0.001, 1.0),
    block=st.sampled_from([16, 32, 128]),
    generated=st.integers(0, 5_000),
)
def test_the_blocks_vllm_allocates_by_position_always_cover_the_cache_index(
    prompt: int, share: float, block: int, generated: int
) -> None:
    """The scheduler allocates by position (``ceil((p + 1) / bs)`` blocks for the token at ``p``);
    without the freed ones they must hold cache index ``p - evicted``, and at most one block more."""
    kept = max(1, min(prompt, math.floor(share * prompt)))
    first, last = freed_blocks(kept, prompt, block)
    position = prompt + generated
    allocated = math.ceil((position + 1) / block) - (last - first)
    needed = math.ceil((position - (prompt - kept) + 1) / block)
    assert needed <= allocated <= needed + 1
    assert first == math.ceil(kept / block) and last <= math.ceil(prompt / block)


def test_freed_blocks_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError):
        freed_blocks(0, 10, 16)
    with pytest.raises(ValueError):
        freed_blocks(11, 10, 16)
