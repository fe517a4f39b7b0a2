"""Methods declare their needs; options replace parameters of registered methods; binding happens
before a cache exists."""

from __future__ import annotations

from pathlib import Path

import pytest

import criticalkv as ckv
from criticalkv.eval.sweep import SweepConfig
from criticalkv.needs import ALL_QUERIES, NOTHING, Needs
from criticalkv.scores import WindowAttention
from criticalkv.select import Critical
from tests.conftest import make_tiny


def test_every_registered_method_declares_what_it_needs() -> None:
    needs = {name: ckv.get_method(name).needs for name in ckv.available_methods()}
    assert needs["full"] == NOTHING and needs["snapkv"] == NOTHING
    assert needs["h2o"].queries == ALL_QUERIES and needs["h2o"].prefill_only
    assert needs["critical-adakv"] == Needs(value_norms=True)
    assert needs["headkv"] == Needs(head_scores=True)
    assert needs["critical-headkv"] == Needs(head_scores=True, value_norms=True)
    assert needs["defensivekv"] == Needs(ranks=True, value_norms=True)
    assert needs["layer-defensivekv"] == Needs(cross_layer=True, ranks=True, value_norms=True)
    assert needs["expected-attention"].queries == ALL_QUERIES and needs["expected-attention"].prefill_only


def test_needs_merge_takes_the_larger_requirement() -> None:
    assert Needs(queries=8).merge(Needs(queries=3)).queries == 8
    assert Needs(queries=8).merge(Needs(queries=ALL_QUERIES)).queries == ALL_QUERIES
    assert Needs().merge(Needs(cross_layer=True)).cross_layer
    with pytest.raises(ValueError, match="positive integer"):
        Needs(queries=0)


def test_a_part_that_is_not_a_scorer_is_refused_with_a_sentence() -> None:
    with pytest.raises(TypeError, match="scores must be a criticalkv"):
        ckv.Method("mine", "-", "-", lambda state: state.keys.sum(-1))  # type: ignore[arg-type]


def test_get_method_options_replace_parameters_of_the_parts() -> None:
    exact = ckv.get_method("critical-adakv", precision="exact")
    assert isinstance(exact.select, Critical) and exact.select.precision == "exact"
    assert ckv.get_method("critical-adakv").select == Critical()  # the registry is untouched
    assert ckv.get_method("snapkv", kernel=7).scores == WindowAttention(kernel=7)
    assert ckv.get_method("snapkv").options() == {"pool": "avg", "kernel": 5}
    with pytest.raises(ValueError, match="has no option 'precision'; its options:"):
        ckv.get_method("snapkv", precision="exact")
    with pytest.raises(ValueError, match="precision must be one of"):
        ckv.get_method("critical-snapkv", precision="fp3")


def test_norm_precision_applies_only_where_value_norms_are_read() -> None:
    snapkv = ckv.get_method("snapkv")
    assert snapkv.with_norm_precision("exact") is snapkv
    assert ckv.get_method("defensivekv").with_norm_precision("exact").select.precision == "exact"  # type: ignore[attr-defined]


def test_binding_happens_before_a_cache_exists() -> None:
    headkv = ckv.get_method("headkv")
    assert not headkv.bound
    with pytest.raises(ValueError, match="bound to the model before a cache exists"):
        ckv.CompressedCache(3, headkv, 0.3, window=4)
    with pytest.raises(ValueError, match="no head importance scores"):
        ckv.bind(headkv, make_tiny("llama"))  # no scores for a random model: the sentence says how to get them
    assert ckv.bind(ckv.get_method("snapkv"), make_tiny("llama")) == ckv.get_method("snapkv")


def test_eval_norm_precision_is_in_the_identity_only_when_set(tmp_path: Path) -> None:
    plain = SweepConfig(out=tmp_path, tasks=["niah_single_1"])
    exact = SweepConfig(out=tmp_path, tasks=["niah_single_1"], norm_precision="exact")
    assert "norm_precision" not in plain.identity() and "norm_precision" not in plain.to_json()
    assert exact.identity() == {**plain.identity(), "norm_precision": "exact"}
    with pytest.raises(ValueError, match="norm precision must be one of"):
        SweepConfig(out=tmp_path, tasks=["niah_single_1"], norm_precision="fp3")
