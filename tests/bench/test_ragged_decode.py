"""benchmarks/ragged_decode.py: its specs and its interval of the median paired ratio."""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from criticalkv.serve.cancel import Cancelled, cancellable, check_cancelled
from tests.conftest import make_tiny

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ragged_decode_under_test", BENCHMARKS / "ragged_decode.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ragged_decode = _load()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(min_value=0.5, max_value=2.0), min_size=3, max_size=40))
def test_the_interval_lies_within_the_data(ratios: list[float]) -> None:
    low, high = ragged_decode.median_interval(ratios, resamples=200)
    assert min(ratios) <= low <= high <= max(ratios)


def test_the_interval_holds_the_median_of_symmetric_data() -> None:
    ratios = [1.0 + 0.01 * i for i in range(-50, 51)]
    low, high = ragged_decode.median_interval(ratios)
    assert low < statistics.median(ratios) == 1.0 < high
    assert high - low < 0.5  # 0.2 for these 101 points (seeded); far narrower than the data's range of 1.0


def test_the_interval_narrows_with_more_steps() -> None:
    few = [1.0, 1.1, 0.9, 1.05, 0.95] * 2
    many = few * 20
    low_few, high_few = ragged_decode.median_interval(few)
    low_many, high_many = ragged_decode.median_interval(many)
    assert high_many - low_many < high_few - low_few


def test_specs_name_method_budget_and_bits() -> None:
    assert ragged_decode.parse("adakv@0.2", 16) == ("adakv", 0.2, 16)
    assert ragged_decode.parse("adakv@0.2:4", 16) == ("adakv", 0.2, 4)
    assert ragged_decode.parse("snapkv@512", 8) == ("snapkv", 512, 8)
    for bad in ("adakv", "adakv@", "adakv@0.2:3", "@0.2"):
        with pytest.raises(ValueError, match=r"METHOD@BUDGET\[:BITS\]"):
            ragged_decode.parse(bad, 16)


def test_a_cancel_spec_adds_the_servers_check_before_every_layer_for_its_steps_only() -> None:
    assert ragged_decode.parse("critical-adakv@0.2:4/c+cancel", 16) == ("critical-adakv", 0.2, 4)
    assert ragged_decode.kernel_of("critical-adakv@0.2:4/c+cancel") == "c"
    model = make_tiny("llama")
    layers = model.get_decoder().layers
    assert ragged_decode.cancel_hooks(model, "adakv@0.2") == []
    hooks = ragged_decode.cancel_hooks(model, "adakv@0.2+cancel")
    assert len(hooks) == len(layers)
    assert all(list(layer._forward_pre_hooks.values()) == [check_cancelled] for layer in layers)  # the server's own
    event = threading.Event()
    event.set()
    with pytest.raises(Cancelled), cancellable(event):
        check_cancelled(layers[0], ())
    # (not through a forward of the model: a Cancelled raised inside a tiny model's forward here made a
    # later live-server test's layer hook miss its forward; see tests/serve/test_serve_prompts.py)
    for hook in hooks:
        hook.remove()
    assert all(not layer._forward_pre_hooks for layer in layers)


def test_a_spec_choice_sets_one_variable_for_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRITICALKV_KERNEL", "torch")
    ragged_decode.use_kernel("adakv@0.2/op")
    assert os.environ.get("CRITICALKV_DECODE") == "op" and "CRITICALKV_KERNEL" not in os.environ
    ragged_decode.use_kernel("adakv@0.2:4/c")
    assert os.environ.get("CRITICALKV_KERNEL") == "c" and "CRITICALKV_DECODE" not in os.environ
    ragged_decode.use_kernel("adakv@0.2")
    assert "CRITICALKV_KERNEL" not in os.environ and "CRITICALKV_DECODE" not in os.environ
    with pytest.raises(ValueError, match="/op or /native"):
        ragged_decode.kernel_of("adakv@0.2/fast")
