"""Prompts compressed together, then split into single-row caches (the server's batched prefill).

Oracle: each row of a left-padded batch, split out, is the cache its prompt gets compressed
alone: the same kept entries, the same logits after the prompt, the same logits at every decode
step beside other rows (:func:`criticalkv.runtime.decode_rows`), and the same logical length.
"""

from __future__ import annotations

import pytest
import torch

import criticalkv as ckv
from criticalkv.cache import bind_spec
from criticalkv.cache.batch import split_rows
from criticalkv.runtime import decode_rows
from tests.conftest import make_tiny, padded_batch

MODEL = ckv.attach(make_tiny("llama"))
LENGTHS = [41, 64, 29]


def alone(
    ids: torch.Tensor, mask: torch.Tensor, spec: ckv.CacheSpec, r: int
) -> tuple[ckv.CompressedCache, torch.Tensor]:
    real = ids[r : r + 1, mask[r].bool()]
    cache, last = ckv.compress_prompt(MODEL, real, torch.ones_like(real), spec)
    return cache, last[0]


@torch.no_grad()
@pytest.mark.parametrize("method", ["snapkv", "critical-snapkv", "critical-adakv", "layer-defensivekv", "full"])
def test_each_split_row_is_its_prompt_compressed_alone(method: str) -> None:
    ids, mask = padded_batch(LENGTHS, seed=7)
    spec = bind_spec(ckv.CacheSpec.of(method, 1.0 if method == "full" else 0.4, 4), MODEL)
    batch, last = ckv.compress_prompt(MODEL, ids, mask, spec)
    rows = split_rows(batch, LENGTHS)
    references = [alone(ids, mask, spec, r) for r in range(len(LENGTHS))]
    for r, (row, (reference, expected)) in enumerate(zip(rows, references, strict=True)):
        assert row.get_seq_length() == LENGTHS[r]
        assert torch.equal(row.kept_entries(), reference.kept_entries())
        for ours, theirs in zip(row.keep_masks(), reference.keep_masks(), strict=True):
            assert torch.equal(ours, theirs)
        torch.testing.assert_close(last[r], expected, rtol=1e-4, atol=1e-4)
        assert row.kv_bytes() == reference.kv_bytes()
    tokens = [int(t) for t in last.argmax(-1)]
    for _ in range(3):
        ours = decode_rows(MODEL, rows, tokens)
        theirs = decode_rows(MODEL, [c for c, _ in references], tokens)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        tokens = [int(t) for t in ours.argmax(-1)]


@torch.no_grad()
def test_split_rows_refuses_what_does_not_describe_the_batch() -> None:
    ids, mask = padded_batch(LENGTHS, seed=8)
    batch, _ = ckv.compress_prompt(MODEL, ids, mask, bind_spec(ckv.CacheSpec.of("snapkv", 0.4, 4), MODEL))
    with pytest.raises(ValueError, match="3 rows but 2 lengths"):
        split_rows(batch, LENGTHS[:2])
    with pytest.raises(ValueError, match=r"row lengths must be in \[1, 64\]"):
        split_rows(batch, [41, 65, 29])
    with pytest.raises(ValueError, match="kept entries of its padding"):
        split_rows(batch, [10, 64, 29])  # row 0 kept positions before its claimed start
    empty = ckv.CompressedCache.for_model(MODEL, "snapkv", 0.4, window=4)
    with pytest.raises(ValueError, match="no compressed prompt"):
        split_rows(empty, [4])


@torch.no_grad()
def test_a_split_row_leaves_the_batch_and_its_siblings_untouched() -> None:
    ids, mask = padded_batch(LENGTHS, seed=9)
    batch, last = ckv.compress_prompt(MODEL, ids, mask, bind_spec(ckv.CacheSpec.of("snapkv", 0.4, 4), MODEL))
    rows = split_rows(batch, LENGTHS)
    before = [row.kept_entries().clone() for row in rows[1:]]
    decode_rows(MODEL, rows[:1], [int(last[0].argmax())])  # row 0 grows its own tail only
    assert rows[0].get_seq_length() == LENGTHS[0] + 1
    assert [row.get_seq_length() for row in rows[1:]] == LENGTHS[1:]
    for row, kept in zip(rows[1:], before, strict=True):
        assert torch.equal(row.kept_entries(), kept)
