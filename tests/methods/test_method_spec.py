"""Method specs ``name:key=value``: parsing, the canonical name, validation, and a sweep that records them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import criticalkv as ckv
from criticalkv.commands.common import methods_arg
from criticalkv.eval import results as sweep_results
from criticalkv.eval.sweep import SweepConfig, run_sweep
from criticalkv.methods.spec_string import format_spec, parse_spec
from tests.conftest import make_tiny
from tests.helpers.random_state import random_state
from tests.helpers.tiny_tokenizer import char_tokenizer


def test_parse_and_canonical_spelling() -> None:
    assert parse_spec("critical-snapkv") == ("critical-snapkv", {})
    name, options = parse_spec("critical-snapkv:eps=1e-4:projected=False:alpha=0.25:precision=exact")
    assert name == "critical-snapkv"
    assert options == {"eps": 1e-4, "projected": False, "alpha": 0.25, "precision": "exact"}
    assert format_spec(name, options) == "critical-snapkv:alpha=0.25:eps=0.0001:precision=exact:projected=false"
    assert ckv.get_method("critical-snapkv:eps=0.0001").name == ckv.get_method("critical-snapkv:eps=1e-4").name


@settings(max_examples=50, deadline=None)
@given(
    eps=st.floats(0, 1, allow_nan=False),
    alpha=st.floats(0, 1, allow_nan=False),
    projected=st.booleans(),
)
def test_the_canonical_spec_builds_the_same_method(eps: float, alpha: float, projected: bool) -> None:
    method = ckv.get_method("critical-adakv", eps=eps, alpha=alpha, projected=projected)
    spec = format_spec("critical-adakv", {"eps": eps, "alpha": alpha, "projected": projected})
    again = ckv.get_method(spec)
    assert again.name == spec and ckv.get_method(again.name).name == spec
    # %g keeps 6 significant digits: the rebuilt parameters agree to that precision
    assert again.select.projected is projected  # type: ignore[attr-defined]
    assert again.select.alpha == pytest.approx(method.select.alpha, rel=1e-5, abs=1e-12)  # type: ignore[attr-defined]
    assert again.select.eps == pytest.approx(method.select.eps, rel=1e-5, abs=1e-12)  # type: ignore[attr-defined]


def test_a_spec_selects_what_the_options_select() -> None:
    state = random_state(3, lengths=[40, 31], num_kv_heads=2, group=3, head_dim=8, window=4)
    tokens = torch.tensor([12, 12])
    by_spec = ckv.get_method("critical-snapkv:eps=0:alpha=0.25").keep_mask(state, tokens)
    by_options = ckv.get_method("critical-snapkv", eps=0.0, alpha=0.25).keep_mask(state, tokens)
    assert torch.equal(by_spec, by_options)


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("nope:eps=0", ValueError, "unknown method 'nope'"),
        ("critical-snapkv:eps", ValueError, "KEY=VALUE"),
        ("critical-snapkv:=3", ValueError, "KEY=VALUE"),
        ("critical-snapkv:eps=", ValueError, "has no value"),
        ("critical-snapkv:eps=0:eps=1", ValueError, "twice"),
        ("critical-snapkv:eps=nan", ValueError, "finite"),
        ("critical-snapkv:beta=1", ValueError, "no option 'beta'"),
        ("critical-snapkv:alpha=2", ValueError, "alpha must be in"),
    ],
)
def test_bad_specs_say_what_to_write(spec: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ckv.get_method(spec)
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        methods_arg(f"snapkv,{spec}")


def test_a_sweep_records_each_spec_as_its_own_method(tmp_path: Path) -> None:
    model, tok = ckv.attach(make_tiny("llama")), char_tokenizer()
    specs = methods_arg("full,critical-snapkv,critical-snapkv:eps=0,critical-snapkv:projected=false")
    kwargs: dict[str, Any] = {"tasks": ["niah_single_1"], "lengths": [600], "budgets": [0.3], "samples": 1}
    config = SweepConfig(
        out=tmp_path / "run",
        methods=specs,
        window=8,
        max_new_tokens=3,
        model="tiny",
        **kwargs,  # type: ignore[arg-type]
    )
    run_sweep(config, model, tok)
    methods = sorted({r["method"] for r in sweep_results.read_results(tmp_path / "run")})
    assert methods == ["critical-snapkv", "critical-snapkv:eps=0", "critical-snapkv:projected=false", "full"]
