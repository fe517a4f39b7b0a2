"""Every storage attends through ``torch.ops.criticalkv.ragged_decode`` when asked
(``CRITICALKV_DECODE=op``, the path CUDA takes where the Triton kernel is registered): the same
logits as the storage's own CPU kernels (themselves oracle-tested against a masked full cache),
over ragged and uniform budgets, 16/8/4-bit storage, padded batches, an appended chunk, decode
steps, a decode budget's re-selections and a fork."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import criticalkv as ckv
from criticalkv.compat import cache_argument
from criticalkv.ops import DECODE_ENV, decode_through_op
from criticalkv.prompts import positions
from tests.conftest import make_tiny, padded_batch

STORAGES: list[dict[str, Any]] = [
    {},
    {"kv_bits": 8, "kv_group_size": 4},
    {"kv_bits": 4, "kv_group_size": 8, "kv_residual": 3},
]


@torch.no_grad()
def decode_logits(model: Any, method: str, options: dict[str, Any], steps: int = 6, fork: bool = False) -> torch.Tensor:
    """The prefill's and every later step's logits: a left-padded 4-token chunk, then single tokens."""
    ids, mask = padded_batch([34, 27], seed=11)
    cache = ckv.CompressedCache.for_model(model, method, 0.5, window=4, **options)
    outs = [
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **cache_argument(model, cache)).logits[
            :, -1
        ]
    ]
    if fork:
        cache = cache.fork()
    g = torch.Generator().manual_seed(5)
    chunk_mask = torch.ones(2, 4, dtype=torch.long)
    chunk_mask[1, :2] = 0
    feeds = [(torch.randint(3, 100, (2, 4), generator=g), chunk_mask)]
    feeds += [(torch.randint(3, 100, (2, 1), generator=g), torch.ones(2, 1, dtype=torch.long)) for _ in range(steps)]
    for tokens, new_mask in feeds:
        mask = torch.cat([mask, new_mask], dim=1)
        pos = positions(mask)[:, -tokens.shape[1] :]
        out = model(input_ids=tokens, attention_mask=mask, position_ids=pos, **cache_argument(model, cache))
        outs.append(out.logits[:, -1])
    return torch.stack(outs)


@pytest.fixture(scope="module")
def model() -> Any:
    return ckv.attach(make_tiny("qwen2"))


@pytest.mark.parametrize("storage", STORAGES, ids=["16-bit", "8-bit", "4-bit"])
@pytest.mark.parametrize("method", ["snapkv", "adakv", "pyramidkv", "critical-adakv"])
def test_the_op_path_decodes_like_the_native_kernels(
    model: Any, method: str, storage: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DECODE_ENV, "native")
    native = decode_logits(model, method, storage)
    monkeypatch.setenv(DECODE_ENV, "op")
    assert decode_through_op(torch.device("cpu"))
    through_op = decode_logits(model, method, storage)
    torch.testing.assert_close(through_op, native, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("storage", STORAGES[::2], ids=["16-bit", "4-bit"])
def test_the_op_path_under_a_decode_budget_and_after_a_fork(
    model: Any, storage: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {**storage, "decode_budget": 12, "decode_interval": 3}
    monkeypatch.setenv(DECODE_ENV, "native")
    native = decode_logits(model, "adakv", options, steps=9), decode_logits(model, "snapkv", storage, fork=True)
    monkeypatch.setenv(DECODE_ENV, "op")
    through_op = decode_logits(model, "adakv", options, steps=9), decode_logits(model, "snapkv", storage, fork=True)
    for a, b in zip(through_op, native, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


def test_a_bad_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DECODE_ENV, "fast")
    with pytest.raises(ValueError, match="CRITICALKV_DECODE must be one of auto, op, native"):
        decode_through_op(torch.device("cpu"))
