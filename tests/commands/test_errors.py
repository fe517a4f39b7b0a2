"""Bad input gives a clear error that says what to do, raised where the input enters."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

import criticalkv as ckv
from criticalkv.budgets import Adaptive
from criticalkv.budgets.resolve import parse_budget, resolve_budget, validate_budget
from criticalkv.cache import CaptureCache
from criticalkv.prompts import positions
from criticalkv.scores import WindowAttention, projected_value_norms
from criticalkv.select import Critical
from tests.conftest import make_tiny, padded_batch

LENGTHS = torch.tensor([100, 80])


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return ckv.attach(make_tiny("llama"))


# --- budgets -------------------------------------------------------------------------------------

BAD_VALUES = [
    (0, ValueError, "below 1"),
    (-1, ValueError, "below 1"),
    (0.0, ValueError, r"fraction in \(0, 1\]"),
    (-0.5, ValueError, r"fraction in \(0, 1\]"),
    (1.5, ValueError, r"fraction in \(0, 1\]"),
    (float("nan"), ValueError, r"fraction in \(0, 1\]"),
    (float("inf"), ValueError, r"fraction in \(0, 1\]"),
    (True, TypeError, "fraction .* or a token count"),
    ("abc", TypeError, "fraction .* or a token count"),
    ("0.2", TypeError, "fraction .* or a token count"),
    (None, TypeError, "fraction .* or a token count"),
]


@pytest.mark.parametrize(("budget", "error", "message"), BAD_VALUES)
def test_validate_budget_rejects(budget: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        validate_budget(budget)


@pytest.mark.parametrize(("budget", "error", "message"), BAD_VALUES)
def test_resolve_budget_rejects(budget: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        resolve_budget(budget, LENGTHS, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "below 1"),
        ("-1", r"fraction in \(0, 1\]"),
        ("1.5", r"fraction in \(0, 1\]"),
        ("nan", r"fraction in \(0, 1\]"),
        ("abc", "neither a fraction like 0.2 nor a token count like 512"),
        ("", "neither a fraction"),
        ("True", "neither a fraction"),
        ("20%", "neither a fraction"),
    ],
)
def test_parse_budget_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_budget(text)


ACCEPTED = [("0.2", 0.2), (" 512 ", 512), ("+64", 64), ("1", 1), ("1.0", 1.0)]


@pytest.mark.parametrize(("text", "value"), ACCEPTED)
def test_parse_budget_accepts(text: str, value: float) -> None:
    parsed = parse_budget(text)
    assert parsed == value and type(parsed) is type(value)


def test_token_budget_above_the_context() -> None:
    with pytest.raises(ValueError, match=r"exceeds the context length \(80 tokens\)"):
        resolve_budget(81, LENGTHS, 8)
    assert resolve_budget(80, LENGTHS, 8).tolist() == [80, 80]


def test_budget_below_the_window() -> None:
    with pytest.raises(ValueError, match=r"smaller than the observation window \(8 tokens\)"):
        resolve_budget(7, LENGTHS, 8)
    message = r"budget \(8 tokens per head\) is smaller than the observation window"
    with pytest.raises(ValueError, match=message):
        resolve_budget(0.1, LENGTHS, 9)  # floor(0.1 * 80) = 8 < 9
    assert resolve_budget(0.1, LENGTHS, 8).tolist() == [10, 8]


def test_budget_errors_surface_in_the_forward(model: PreTrainedModel) -> None:
    """A budget that fits no prompt is reported by the prefill with resolve_budget's message."""
    ids, mask = padded_batch([40, 30])
    for budget, message in [(35, "exceeds the context length"), (0.1, "smaller than the observation window")]:
        cache = ckv.CompressedCache.for_model(model, "snapkv", budget, window=8)
        with torch.no_grad(), pytest.raises(ValueError, match=message):
            model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)


# --- methods and caches --------------------------------------------------------------------------


def test_unknown_method_lists_the_registered_names() -> None:
    with pytest.raises(ValueError, match="unknown method 'nope'") as info:
        ckv.get_method("nope")
    for name in ckv.available_methods():
        assert name in str(info.value)
    with pytest.raises(ValueError, match="choose one of"):
        ckv.CompressedCache(3, "nope")
    with pytest.raises(ValueError, match="unknown method"):
        ckv.get_method(None)  # type: ignore[arg-type]


def test_register_takes_a_method_under_its_own_name() -> None:
    from criticalkv.methods.registry import method_colour

    snapkv = ckv.get_method("snapkv")
    before, colour = ckv.available_methods(), method_colour("snapkv")
    ckv.register(snapkv)  # the same method again: it replaces itself, in its place, in its colour
    assert ckv.available_methods() == before and ckv.get_method("snapkv") == snapkv
    assert colour is not None and method_colour("snapkv") == colour
    with pytest.raises(TypeError, match="needs a criticalkv Method, not 'snapkv'"):
        ckv.register("snapkv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a method name must be a non-empty string"):
        ckv.register(ckv.Method("", "nothing", "-", None))


@pytest.mark.parametrize("window", [0, -3, True, 2.5, "8"])
def test_bad_window(window: object) -> None:
    with pytest.raises(ValueError, match="window must be a positive integer"):
        ckv.CompressedCache(3, "snapkv", 0.2, window=window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window must be a positive integer"):
        CaptureCache(3, window=window)  # type: ignore[arg-type]


def test_cache_rejects_a_bad_budget_up_front() -> None:
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\]"):
        ckv.CompressedCache(3, "snapkv", 1.5)
    with pytest.raises(TypeError, match="token count"):
        ckv.CompressedCache(3, "snapkv", "0.2")  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["full", "snapkv", "critical-adakv"])
def test_prompt_shorter_than_the_window(model: PreTrainedModel, method: str) -> None:
    ids, mask = padded_batch([12, 5])
    cache = ckv.CompressedCache.for_model(model, method, 1.0, window=8)
    with torch.no_grad(), pytest.raises(ValueError, match=r"5 tokens is shorter than the observation window"):
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    capture = CaptureCache(model.config.num_hidden_layers, window=8)
    with torch.no_grad(), pytest.raises(ValueError, match="window"):
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=capture)


@pytest.mark.parametrize("method", ["snapkv", "critical-adakv"])
def test_prompt_exactly_the_window(model: PreTrainedModel, method: str) -> None:
    """The shortest legal prompt (nothing outside the window) compresses to the window itself."""
    ids, mask = padded_batch([8, 8])
    cache = ckv.CompressedCache.for_model(model, method, 1.0, window=8)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    assert bool(cache.kept_entries().eq(8).all())


def test_states_before_a_prefill() -> None:
    with pytest.raises(ValueError, match="run a prefill"):
        CaptureCache(2, window=4).states()
    with pytest.raises(ValueError, match="no layer states"):
        ckv.CompressedCache.from_states([], "snapkv", 0.2)
    with pytest.raises(ValueError, match="no compressed prompt"):
        ckv.CompressedCache(2).keep_masks()


# --- components ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: WindowAttention(kernel=4), "kernel must be a positive odd integer"),
        (lambda: WindowAttention(kernel=0), "kernel must be a positive odd integer"),
        (lambda: WindowAttention(pool="median"), "pool must be"),  # type: ignore[arg-type]
        (lambda: Adaptive(alpha_floor=2), r"alpha_floor must be in \[0, 1\]"),
        (lambda: Adaptive(alpha_floor=-0.1), r"alpha_floor must be in \[0, 1\]"),
        (lambda: Critical(alpha=-1), r"alpha must be in \[0, 1\]"),
        (lambda: Critical(alpha=1.5), r"alpha must be in \[0, 1\]"),
        (lambda: Critical(eps=-1e-4), "eps must be >= 0"),
        (lambda: Critical(p=3), "p must be 1 or 2"),
    ],
)
def test_bad_component_parameters(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_projected_value_norms_checks_shapes() -> None:
    values = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="p must be 1 or 2"):
        projected_value_norms(values, torch.randn(8, 16), p=3)
    with pytest.raises(ValueError, match=r"does not match values with 2 KV heads of size 4"):
        projected_value_norms(values, torch.randn(8, 18))  # 18 is not a multiple of d = 4
    with pytest.raises(ValueError, match=r"does not match values with 2 KV heads"):
        projected_value_norms(values, torch.randn(8, 12))  # 3 query heads cannot share 2 KV heads
