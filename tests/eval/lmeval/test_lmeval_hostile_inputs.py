"""Hostile ``model_args`` and lm-eval's own settings, through lm-eval as the client (issue 41):
an option is used as given or refused in one sentence, never replaced; a run that compresses
nothing says so and records it; ``batch_size``/``device`` in ``model_args`` beside lm-eval's own."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.lmeval_tasks import evaluate, save_tiny, task_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lmeval-hostile")
    return save_tiny(root / "tiny"), task_folder(root / "tasks")


@pytest.mark.parametrize(
    ("model_args", "refusal"),
    [
        ("window=0", "window"),  # was run with 32
        ("window=1.5", "window must be a whole number"),  # was run with 1
        ("window=32.0", "whole number"),
        ("kv_bits=0", "kv_bits"),  # was run in 16 bits
        ("kv_bits=true", "kv_bits"),
        ("decode_interval=0", "decode_interval"),  # was run with 64
        ("decode_budget=64,decode_interval=0", "decode_interval"),
        ("kv_group_size=32", "kv_group_size"),  # ignored without kv_bits
        ("budget=true", "budget"),
        ("max_length=0", "max_length"),  # recorded, but the model's length used
        ("max_length=1.5", "max_length"),
        ("max_batch_size=0", "max_batch_size"),
    ],
)
def test_a_replaced_option_is_refused_before_the_model_loads(model_args: str, refusal: str) -> None:
    from lm_eval.utils import simple_parse_args_string

    from criticalkv.eval.lmeval import LMEvalOptions

    with pytest.raises(ValueError, match=refusal):
        LMEvalOptions.parse(pretrained="no-such-folder", **simple_parse_args_string(model_args))


def test_the_given_values_are_the_ones_used() -> None:
    from lm_eval.utils import simple_parse_args_string

    from criticalkv.eval.lmeval import LMEvalOptions

    args = "window=7,kv_bits=8,decode_budget=40,decode_interval=3,max_length=100,budget=0.3,batch_size=2"
    options = LMEvalOptions.parse(**simple_parse_args_string(args))
    assert options.spec.window == 7 and options.spec.kv_bits == 8
    assert options.spec.decode is not None and options.spec.decode.interval == 3 and options.spec.budget == 0.3
    assert options.max_length == 100 and options.batch_size == 2


def test_model_args_take_every_cache_option() -> None:
    """The cache options are the core's (``SPEC_OPTIONS``): ``kv_residual`` too (it was refused as unknown)."""
    from lm_eval.utils import simple_parse_args_string

    from criticalkv.cache.quantized import KVQuantization
    from criticalkv.defaults import SPEC_OPTIONS
    from criticalkv.eval.lmeval import MODEL_ARGS, LMEvalOptions

    assert set(SPEC_OPTIONS) <= set(MODEL_ARGS)
    options = LMEvalOptions.parse(**simple_parse_args_string("kv_bits=8,kv_group_size=16,kv_residual=4"))
    assert options.spec.storage == KVQuantization(8, 16, 4)


def test_the_shared_parser_refuses_every_replacement() -> None:
    """:meth:`CacheSpec.parse`, the one validation the server and the command line share."""
    from criticalkv.cache import CacheSpec
    from criticalkv.options import OptionError

    assert CacheSpec.parse({"window": "8", "budget": "0.5", "method": "snapkv"}).window == 8
    assert CacheSpec.parse({"budget": "512"}).budget == 512
    assert CacheSpec.parse({"window": None}, defaults={"window": 16}).window == 16
    for bad in ({"window": 1.5}, {"window": True}, {"window": "1.5"}, {"kv_bits": 0}, {"decode_interval": 0}):
        with pytest.raises(OptionError):
            CacheSpec.parse(bad)
    with pytest.raises(OptionError, match="kv_residual"):
        CacheSpec.parse({"kv_residual": 4})


def test_batch_size_auto_is_refused_with_the_alternative() -> None:
    from criticalkv.eval.lmeval import LMEvalOptions

    for value in ("auto", "auto:4"):
        with pytest.raises(ValueError, match=r"not supported.*--batch_size 8"):
            LMEvalOptions.parse(batch_size=value)


def test_a_window_no_prompt_can_hold_is_refused_through_lm_eval(folders: tuple[Path, Path]) -> None:
    """``window=5000`` kept every prompt whole, labelled with the method."""
    model, tasks = folders
    with pytest.raises(ValueError, match=r"compresses no prompt of at most max_length=\d+ tokens"):
        evaluate("criticalkv", f"pretrained={model},method=snapkv,window=5000", ["ckv_generate"], tasks, limit=1)


def test_a_run_that_compresses_nothing_says_so_and_records_it(
    folders: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    model, tasks = folders
    with caplog.at_level(logging.WARNING, logger="criticalkv"):
        results = evaluate(
            "criticalkv", f"pretrained={model},method=snapkv,budget=0.4,window=8", ["ckv_rolling"], tasks
        )
    info = results["config"]["criticalkv"]
    assert info["compressed_nothing"] is True and info["prompts_kept_whole"] == info["prompts"] > 0
    assert "compressed NONE of the" in caplog.text


def test_batch_size_and_device_in_model_args_beside_lm_evals_own(folders: tuple[Path, Path]) -> None:
    """lm-eval passes ``batch_size`` and ``device`` itself: ``model_args``' win (they crashed)."""
    model, tasks = folders
    args = f"pretrained={model},method=snapkv,budget=0.4,window=8,batch_size=2,device=cpu"
    results: dict[str, Any] = evaluate("criticalkv", args, ["ckv_generate"], tasks, limit=2, device="cuda:0")
    assert results["config"]["criticalkv"]["prompts"] == 2
    assert results["config"]["batch_size"] in (1, "1")  # lm-eval's own record of its flag


def test_lm_evals_default_cuda_falls_back_to_the_cpu(
    folders: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without ``--device`` lm-eval passes ``cuda:0``; on a machine without CUDA, the CPU (logged)."""
    model, tasks = folders
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="criticalkv"):
        results = evaluate(
            "criticalkv", f"pretrained={model},method=full", ["ckv_generate"], tasks, limit=1, device="cuda:0"
        )
    assert results["config"]["criticalkv"]["prompts"] == 1
    assert "device cuda:0 is not available" in caplog.text


def test_the_python_api_refuses_an_interval_it_would_ignore() -> None:
    """``CacheSpec.of(decode_interval=8)`` without a decode budget ignored the interval."""
    import criticalkv as ckv
    from criticalkv.cache import CacheSpec

    for interval in (0, 8):
        with pytest.raises(ValueError, match="decode_interval re-selects under a decode budget"):
            CacheSpec.of("snapkv", 0.2, 8, decode_interval=interval)
    assert CacheSpec.of("snapkv", 0.2, 8, decode_budget=16, decode_interval=8).decode == ckv.DecodeBudget(16, 8)
