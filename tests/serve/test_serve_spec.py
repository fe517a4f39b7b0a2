"""The server's cache is one :class:`CacheSpec`: the default (``ServerConfig.spec``), a request's
(the default with its method, budget and window), a stored context's (read back from its file)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from criticalkv import CacheSpec, CompressedCache, attach
from criticalkv.cache.quantized import KVQuantization
from criticalkv.cli import main
from criticalkv.runtime import prefill_into
from criticalkv.serve import ServerConfig
from criticalkv.serve.errors import APIError
from criticalkv.serve.prepare import compression_for
from criticalkv.serve.schemas import Compression
from criticalkv.serve.session import ChatWork, Session
from criticalkv.serve.store import ContextStore
from tests.conftest import make_tiny, padded_batch
from tests.helpers.tiny_tokenizer import char_tokenizer

QUANTIZED = CacheSpec.of("snapkv", 0.5, 4, kv_bits=4, kv_residual=3)


def config(spec: CacheSpec = QUANTIZED, **settings: object) -> ServerConfig:
    return ServerConfig(spec=spec, methods=("critical-snapkv", "kvzip"), max_window=16, **settings)  # type: ignore[arg-type]


def test_a_requests_spec_is_the_servers_with_its_method_budget_and_window() -> None:
    served = config()
    assert served.spec_for(None, None, None) == QUANTIZED
    asked = served.spec_for("critical-snapkv", 1, 8)
    assert asked.method.name == "critical-snapkv" and asked.window == 8
    assert asked.budget == 1.0 and isinstance(asked.budget, float)  # a fraction: the whole context, not one token
    assert asked.storage == QUANTIZED.storage  # the storage is the server's
    assert served.allowed_methods() == ("snapkv", "critical-snapkv", "kvzip")


@pytest.mark.parametrize(
    ("asked", "param"),
    [
        ({"method": "h2o"}, "method"),
        ({"budget": 0.001}, "budget"),
        ({"budget": True}, "budget"),
        ({"window": 17}, "window"),
        ({"window": 0}, "window"),
    ],
)
def test_a_request_option_out_of_the_limits_is_a_400_naming_it(asked: dict, param: str) -> None:
    options = {"method": None, "budget": None, "window": None, **asked}
    with pytest.raises(APIError) as refused:
        config().spec_for(**options)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_a_budget_the_core_refuses_is_a_400_naming_the_budget() -> None:
    """``--min-budget 0`` lets a request ask for budget 0, which no cache can hold: the core's check."""
    with pytest.raises(APIError) as refused:
        config(min_budget=0.0).spec_for(None, 0.0, None)
    assert (refused.value.status, refused.value.param) == (400, "budget")


def prepare(served: ServerConfig, tokens: int, what: str = "prompt", **asked: object) -> CacheSpec:
    param = "text" if what == "document" else "prompt"
    return compression_for(SimpleNamespace(config=served), tokens, Compression(**asked), param, what)  # type: ignore[arg-type]


def test_a_short_prompt_at_the_defaults_is_kept_whole_and_one_the_request_set_is_refused() -> None:
    served = config(CacheSpec.of("snapkv", 0.5, 4))
    assert prepare(served, 40) == served.spec  # 20 entries per head hold the window
    kept = prepare(served, 6)  # 3 entries per head cannot hold the window of 4: kept whole
    assert (kept.budget, kept.window) == (1.0, 4)
    assert prepare(served, 3).window == 3  # a prompt within the window is the window
    with pytest.raises(APIError) as refused:
        prepare(served, 6, budget=0.5)
    assert (refused.value.param, refused.value.code) == ("budget", "context_too_short")
    assert "6 tokens" in refused.value.message


def test_the_quantized_residual_is_checked_by_the_core_for_prompts_and_documents() -> None:
    served = config()  # 4-bit storage keeping the newest 3 tokens exact
    with pytest.raises(APIError) as refused:  # budget 1 keeps 2 entries per head: fewer than the residual
        prepare(served, 2)
    assert (refused.value.param, refused.value.code) == ("prompt", "context_too_short")
    assert "residual" in refused.value.message
    served = config(QUANTIZED.replaced(window=2))
    with pytest.raises(APIError) as refused:
        prepare(served, 5, "document")  # 2 entries per head at budget 0.5: the window, not the residual
    assert (refused.value.param, refused.value.code) == ("text", "context_too_short")
    assert "residual" in refused.value.message
    assert prepare(served, 6, "document") == served.spec  # 3 entries per head


def test_the_batch_key_comes_from_the_spec() -> None:
    def key(spec: CacheSpec) -> object:
        work = ChatWork([1, 2, 3], None, spec, 4, 3, 0.0)
        return Session.batch_key(SimpleNamespace(work=work))  # type: ignore[arg-type]

    assert key(CacheSpec.of("snapkv", 0.5, 4)) == ("snapkv", 0.5, 4)
    assert key(QUANTIZED) is None  # a quantized cache cannot split its rows
    assert key(CacheSpec.of("kvzip", 0.5, 4)) is None  # a reconstruction pass per prompt


def test_a_stored_context_reads_its_spec_back_from_its_file(tmp_path: Path) -> None:
    model, tokenizer = attach(make_tiny("llama")), char_tokenizer()
    spec = CacheSpec.of("snapkv", 0.5, 4, kv_bits=4, kv_group_size=16, kv_residual=2)
    cache = CompressedCache.from_spec(model.config.num_hidden_layers, spec)
    tokens, mask = padded_batch([30], seed=3)
    with torch.no_grad():
        prefill_into(model, cache, tokens, mask)
    stored = ContextStore(tmp_path, 10**9, model, tokenizer).add(cache, 30, spec)
    reopened = ContextStore(tmp_path, 10**9, model, tokenizer)
    assert reopened.spec(stored.id) == spec
    assert reopened.spec(stored.id).storage == KVQuantization(4, 16, 2)
    info = reopened.info(stored.id)
    assert (info["method"], info["budget"], info["window"], info["kv_bits"]) == ("snapkv", 0.5, 4, 4)


def test_the_command_spells_a_bad_default_with_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--window", "0", "--port", "1"]) == 2
    assert "--window" in capsys.readouterr().err
    assert main(["serve", "--kv-residual", "4", "--port", "1"]) == 2  # without --kv-bits 8 or 4
    err = capsys.readouterr().err
    assert "--kv-residual" in err and "--kv-bits" in err
