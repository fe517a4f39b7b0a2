"""kvpress's decode-time compression driven token by token (``criticalkv.bench.kvpress_decode``, the
kvpress side of ``benchmarks/decode_compression.py``); skipped where kvpress is not importable."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from criticalkv.bench.kvpress_decode import KVPRESS_DECODE_METHODS, KvpressDecodeStream, kvpress_decode_press
from criticalkv.bench.kvpress_impl import import_kvpress
from tests.conftest import make_tiny, padded_batch

KVPRESS = import_kvpress()
pytestmark = pytest.mark.skipif(KVPRESS is None, reason="kvpress is not installed (make test-kvpress)")

PROMPT, WINDOW = 64, 4


def _press(method: str, prefill: int, budget: int, interval: int) -> object:
    return kvpress_decode_press(
        KVPRESS, method, prompt_tokens=PROMPT, prefill_budget=prefill, window=WINDOW, budget=budget, interval=interval
    )


def _entries(stream: KvpressDecodeStream) -> list[int]:
    return [int(layer.keys.shape[2]) for layer in stream.cache.layers]


@pytest.mark.parametrize("method", sorted(KVPRESS_DECODE_METHODS))
@torch.no_grad()
def test_the_cache_is_cut_to_the_prefill_budget_then_held_at_the_decode_budget(method: str) -> None:
    model = make_tiny("llama")
    ids, _ = padded_batch([PROMPT], seed=1)
    stream = KvpressDecodeStream(model, _press(method, prefill=32, budget=24, interval=8))
    logits = stream.prefill(ids)
    assert _entries(stream) == [32] * 3
    sizes = []
    for _ in range(40):
        logits = stream.step(int(logits.argmax()))
        sizes.append(_entries(stream)[0])
    stream.close()
    assert sizes[:7] == list(range(33, 40))  # the prompt's 32 entries grow until the first cut
    assert sizes[7::8] == [24] * 5  # cut back to 24 at every 8th step
    assert max(sizes[7:]) == 24 + 7
    assert stream.compressions == 5 * 3  # 40 steps / 8, in each of the 3 layers
    assert stream.peak_bytes == max(stream.peak_bytes, stream.kv_bytes()) and stream.peak_bytes > stream.kv_bytes()


@torch.no_grad()
def test_without_eviction_the_stream_decodes_as_the_full_cache() -> None:
    """A prefill budget of the whole prompt and a decode budget above the generated length: the
    logits are those of transformers' own cache fed the same tokens."""
    model = make_tiny("llama")  # the same weights, unhooked (the press hooks the stream's model)
    ids, _ = padded_batch([PROMPT], seed=2)
    stream = KvpressDecodeStream(make_tiny("llama"), _press("snapkv", prefill=PROMPT, budget=200, interval=8))
    ours = [stream.prefill(ids)]
    cache = DynamicCache(config=model.config)
    reference = [model(input_ids=ids, past_key_values=cache).logits[:, -1].float()]
    for step in range(10):
        token = int(reference[-1].argmax())
        ours.append(stream.step(token))
        position = torch.tensor([[PROMPT + step]])
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=position)
        reference.append(out.logits[:, -1].float())
    stream.close()
    assert stream.compressions == 3  # one cut per layer at step 8, with nothing to evict
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"method": "h2o"}, "no decode press"),
        ({"prefill": 0}, "prefill budget"),
        ({"budget": WINDOW}, "exceed the window"),
        ({"interval": 0}, "interval"),
    ],
)
def test_bad_settings_are_refused(changes: dict[str, object], message: str) -> None:
    settings: dict[str, object] = {"method": "snapkv", "prefill": 32, "budget": 24, "interval": 8, **changes}
    with pytest.raises(ValueError, match=message):
        _press(**settings)  # type: ignore[arg-type]


def test_one_row_only() -> None:
    stream = KvpressDecodeStream(make_tiny("llama"), _press("knorm", prefill=32, budget=24, interval=8))
    with pytest.raises(ValueError, match="one row"):
        stream.prefill(torch.ones(2, PROMPT, dtype=torch.long))
