"""One cache spec and one way to compress a prompt: :class:`CacheSpec` checks every option and
rebuilds from its keywords; a cache built from a spec is the cache the keywords build;
:func:`compress_prompt` gives what the cache that compressed itself in the prefill gives, and
KVzip's reconstruction path what capture-then-compress gives; option errors name the caller's
spelling (keywords in Python, flags on the command line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import criticalkv as ckv
from criticalkv.cache import bind_spec
from criticalkv.cli import main
from criticalkv.options import OptionError, OptionTypeError, flag_spelling
from criticalkv.runtime import prefill, prefill_into, prompt_states, repeat_prompt
from tests.conftest import make_tiny, padded_batch
from tests.helpers.tiny_tokenizer import char_tokenizer

# --- option errors ---------------------------------------------------------------------------------


def test_an_option_error_spells_its_options_as_asked() -> None:
    error = OptionError("pass <kv_residual> <= {n} or a larger <budget>, not {value!r}", n=4, value={"a": "{x}"})
    assert str(error) == "pass kv_residual <= 4 or a larger budget, not {'a': '{x}'}"  # braces in a value stay
    flags = flag_spelling("kv_residual", budget="--budgets")
    assert error.spelled(flags) == "pass --kv-residual <= 4 or a larger --budgets, not {'a': '{x}'}"
    assert error.options == ("kv_residual", "budget") and isinstance(error, ValueError)
    assert isinstance(OptionTypeError("<kv_bits> must be an int"), TypeError)


# --- the spec --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"budget": 1.5}, OptionError, "budget 1.5 is not a fraction"),
        ({"budget": True}, TypeError, "budget must be a fraction"),
        ({"window": 0}, OptionError, "window must be a positive integer"),
        ({"decode_budget": 8, "window": 16}, OptionError, "decode_budget 8 is below the observation window"),
        ({"decode_budget": 64, "decode_interval": 0}, OptionError, "decode_interval must be a positive"),
        ({"method": "full", "decode_budget": 64}, OptionError, "drop the decode_budget"),
        ({"method": "kvzip", "decode_budget": 64}, OptionError, "cannot re-select while decoding"),
        ({"kv_bits": 5}, OptionError, "kv_bits must be 16"),
        ({"kv_bits": 4.0}, TypeError, "kv_bits must be an integer"),
        ({"kv_bits": 4, "kv_residual": 80, "budget": 64}, OptionError, "longer than the budget"),
        ({"kv_bits": 4, "kv_residual": 80, "decode_budget": 64}, OptionError, "longer than the decode budget"),
        ({"method": "no-such-method"}, ValueError, "no-such-method"),
    ],
)
def test_the_spec_refuses_bad_options(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ckv.CacheSpec.of(**options)


def test_a_spec_built_directly_is_checked_too() -> None:
    method = ckv.get_method("snapkv")
    with pytest.raises(TypeError, match=r"build it with CacheSpec\.of"):
        ckv.CacheSpec("snapkv", 0.2)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="below the observation window"):
        ckv.CacheSpec(method, 0.2, 32, ckv.DecodeBudget(8))
    assert ckv.CacheSpec(method, 0.2, 32, ckv.DecodeBudget(64)).decode == ckv.DecodeBudget(64, 64)


@settings(max_examples=40, deadline=None)
@given(
    method=st.sampled_from(["snapkv", "critical-adakv", "pyramidkv", "tova"]),
    budget=st.one_of(st.floats(0.05, 1.0), st.integers(64, 512)),
    window=st.integers(1, 64),
    decode=st.one_of(st.none(), st.tuples(st.integers(64, 512), st.integers(1, 128))),
    bits=st.sampled_from([16, 8, 4]),
    group=st.one_of(st.none(), st.sampled_from([8, 16, 32])),
    residual=st.one_of(st.none(), st.integers(0, 64)),
)
def test_a_spec_rebuilds_from_its_keywords(
    method: str,
    budget: float | int,
    window: int,
    decode: tuple[int, int] | None,
    bits: int,
    group: int | None,
    residual: int | None,
) -> None:
    decode_options = {} if decode is None else {"decode_budget": decode[0], "decode_interval": decode[1]}
    storage = {} if bits == 16 else {"kv_bits": bits, "kv_group_size": group, "kv_residual": residual}
    spec = ckv.CacheSpec.of(method, budget, window, **decode_options, **storage)
    assert ckv.CacheSpec.of(**spec.keywords()) == spec
    assert spec.kv_bits == bits and (spec.decode is None) == (decode is None)


def test_a_cache_from_a_spec_is_the_cache_the_keywords_build() -> None:
    model = ckv.attach(make_tiny("llama"))
    ids, mask = padded_batch([40, 30], seed=2)
    options = {"window": 4, "decode_budget": 12, "decode_interval": 3, "kv_bits": 8, "kv_group_size": 4}
    by_keywords = ckv.CompressedCache.for_model(model, "critical-adakv", 0.5, **options)
    spec = bind_spec(ckv.CacheSpec.of("critical-adakv", 0.5, **options), model)
    by_spec = ckv.CompressedCache.from_spec(model.config.num_hidden_layers, spec)
    assert by_keywords.spec == by_spec.spec == spec
    a, b = prefill_into(model, by_keywords, ids, mask), prefill_into(model, by_spec, ids, mask)
    assert torch.equal(a, b) and torch.equal(by_keywords.kept_entries(), by_spec.kept_entries())
    assert by_keywords.decode is not None and by_keywords.decode.budget == 12


def test_headkv_needs_its_scores_bound_before_a_cache_is_built() -> None:
    spec = ckv.CacheSpec.of("headkv", 0.5, 4)
    with pytest.raises(ValueError, match="needs head importance scores bound"):
        ckv.CompressedCache.from_spec(2, spec)


# --- compress_prompt ---------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("method", ["snapkv", "critical-adakv", "h2o", "layer-defensivekv"])
def test_compress_prompt_is_the_cache_that_compressed_itself(method: str) -> None:
    model = ckv.attach(make_tiny("qwen2"))
    ids, mask = padded_batch([36, 28], seed=4)
    own = ckv.CompressedCache.for_model(model, method, 0.4, window=4)
    expected = prefill_into(model, own, ids, mask)
    spec = bind_spec(ckv.CacheSpec.of(method, 0.4, 4), model)
    cache, last = ckv.compress_prompt(model, ids, mask, spec)
    assert torch.equal(last, expected) and torch.equal(cache.kept_entries(), own.kept_entries())
    for ours, theirs in zip(cache.keep_masks(), own.keep_masks(), strict=True):
        assert torch.equal(ours, theirs)


@torch.no_grad()
def test_compress_prompt_runs_kvzips_reconstruction_pass() -> None:
    model, tokenizer = ckv.attach(make_tiny("llama")), char_tokenizer()
    ids, mask = padded_batch([40, 33], seed=5)
    repeat = repeat_prompt(tokenizer, chat=False)
    spec = bind_spec(ckv.CacheSpec.of("kvzip", 0.4, 4), model)
    with pytest.raises(ValueError, match=r"reconstruction=criticalkv\.runtime\.repeat_prompt"):
        ckv.compress_prompt(model, ids, mask, spec)
    cache, last = ckv.compress_prompt(model, ids, mask, spec, reconstruction=repeat)
    states, expected = prefill(model, ids, mask, window=4, reconstruction=repeat)
    reference = ckv.CompressedCache.from_states(states, "kvzip", 0.4, window=4)
    assert torch.equal(last, expected)
    for ours, theirs in zip(cache.keep_masks(), reference.keep_masks(), strict=True):
        assert torch.equal(ours, theirs)
    # the states of prompt_states keep what the merged needs ask, and no pass when none is needed
    plain, _ = prompt_states(model, ids, mask, ckv.get_method("snapkv").needs, window=4)
    assert all(state.reconstruction is None for state in plain)


# --- the command line names its flags ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "full", "--decode-budget", "64"], "or drop the --decode-budget"),
        (["--decode-budget", "4", "--window", "8"], "--decode-budget 4 is below the observation window (8 tokens)"),
        (["--kv-bits", "4", "--kv-residual", "80", "--decode-budget", "64"], "pass --kv-residual <= 64"),
        (["--decode-interval", "8"], "give --decode-budget too"),
    ],
)
def test_generate_names_its_flags_before_the_model_loads(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    context = tmp_path / "context.txt"
    context.write_text("some context", encoding="utf-8")
    base = ["generate", "--model", "/nonexistent/model", "--context-file", str(context), "--question", "q?"]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "decode_budget" not in err and "kv_residual" not in err
