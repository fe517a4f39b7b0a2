"""The decode budget through :func:`criticalkv.generate` and ``criticalkv generate``: results, and
errors that say what to change before any work (no model is loaded for a bad flag)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import criticalkv as ckv
from criticalkv.cli import main
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer

CONTEXT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.mark.parametrize("method", ["snapkv", "layer-defensivekv"])
def test_generate_holds_the_decode_budget(method: str) -> None:
    model, tokenizer = make_tiny("llama"), char_tokenizer()
    kwargs = {"window": 4, "max_new_tokens": 80, "min_new_tokens": 80, "chat": False}
    bounded = ckv.generate(
        model,
        tokenizer,
        [CONTEXT, CONTEXT[:90]],
        ["Who?", "What jumps?"],
        method=method,
        budget=1.0,
        decode_budget=16,
        decode_interval=8,
        **kwargs,
    )
    plain = ckv.generate(
        model, tokenizer, [CONTEXT, CONTEXT[:90]], ["Who?", "What jumps?"], method=method, budget=1.0, **kwargs
    )
    assert bounded.decode_budget == 16 and bounded.decode_interval == 8
    assert plain.decode_budget is None and plain.kv_bytes_peak == plain.kv_bytes_final
    assert bounded.kv_bytes_peak < plain.kv_bytes_peak  # the whole prompt is evicted down to 16 per head
    assert bounded.kv_bytes_final < plain.kv_bytes_final
    assert bounded.new_tokens == plain.new_tokens == [80, 80]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"decode_budget": 2}, "below the observation window"),
        ({"decode_budget": 16, "decode_interval": -1}, "positive number"),
        ({"decode_budget": 16, "method": "h2o"}, "cannot re-select while decoding"),
    ],
)
def test_generate_refuses_bad_decode_options(options: dict[str, object], message: str) -> None:
    model, tokenizer = make_tiny("llama"), char_tokenizer()
    options = {"method": "snapkv", **options}
    with pytest.raises(ValueError, match=message):
        ckv.generate(model, tokenizer, CONTEXT, "Who?", window=4, chat=False, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decode-budget", "8"], "--decode-budget 8 is below the observation window (32 tokens)"),
        (["--decode-budget", "64", "--decode-interval", "0"], "--decode-interval must be a positive number"),
        (["--decode-budget", "64", "--method", "kvzip"], "its scores read the prompt's reconstruction"),
        (["--decode-budget", "64", "--method", "full"], "keeps every entry"),
        (["--min-new-tokens", "40"], "--min-new-tokens must be between 0 and --max-new-tokens"),
    ],
)
def test_cli_refuses_bad_decode_flags(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import criticalkv.models as models

    def no_load(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(models, "load_model", no_load)
    ctx = tmp_path / "c.txt"
    ctx.write_text("some context")
    assert main(["generate", "--context-file", str(ctx), "--question", "q?", *args]) == 2
    assert message in capsys.readouterr().err


def test_decode_budget_tensors_stay_on_the_layer_device() -> None:
    """The bookkeeping (queries, norms) lives where the layer lives; on the CPU here."""
    model = ckv.attach(make_tiny("qwen2"))
    cache = ckv.CompressedCache.for_model(model, "critical-snapkv", 0.5, window=4, decode_budget=8, decode_interval=2)
    ids = torch.randint(3, 100, (1, 30))
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        cache=cache,
    )
    assert cache.decode is not None
    for track in cache.decode.layers.values():
        assert track.queries.device == ids.device and track.queries.shape[2] == 4
