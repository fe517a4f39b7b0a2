"""``torch.ops.criticalkv.ragged_decode``: the torch reference against a loop over sequences on
random ragged layouts (0- and 1-entry sequences, partial blocks, shuffled pool blocks, 16/8/4
bits, tails with masks, GQA row counts), its schema and fake implementation (``opcheck``), the
errors, and a check that the lengths matter (a kernel ignoring them would fail)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import criticalkv.ops  # noqa: F401  (registers the op)
from criticalkv.ops import ragged_decode, ragged_decode_reference
from tests.helpers.ragged_layouts import loop_reference, random_layout


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 23), min_size=1, max_size=6),
    queries=st.sampled_from([1, 3, 4, 8]),
    block_size=st.sampled_from([1, 4, 8]),
    tail=st.integers(0, 5),
    bits=st.sampled_from([16, 8, 4]),
    compact=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_the_reference_equals_a_loop_over_sequences(
    lengths: list[int], queries: int, block_size: int, tail: int, bits: int, compact: bool, seed: int
) -> None:
    layout = random_layout(
        lengths, queries=queries, block_size=block_size, tail=tail, bits=bits, seed=seed, compact=compact
    )
    got = ragged_decode_reference(**layout.inputs)
    assert got.shape == layout.inputs["query"].shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), loop_reference(layout), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    layout = random_layout([7, 0, 1, 16], tail=3, dtype=dtype, seed=3)
    got = ragged_decode(**layout.inputs)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), loop_reference(layout), atol=2e-2, rtol=2e-2)


def test_the_lengths_mask_the_last_partial_block() -> None:
    layout = random_layout([5, 6], block_size=4, seed=1)
    whole = dict(layout.inputs, lengths=torch.tensor([8, 8], dtype=torch.int32))  # the blocks' padding read too
    assert not torch.allclose(ragged_decode(**whole), ragged_decode(**layout.inputs))


def test_schema_and_fake_implementation() -> None:
    layout = random_layout([3, 9, 0], tail=2, bits=4, seed=2, compact=True)
    torch.library.opcheck(torch.ops.criticalkv.ragged_decode.default, (), layout.inputs)
    schema = str(torch.ops.criticalkv.ragged_decode.default._schema)
    assert "Tensor? tail_keys=None" in schema and "bits=16" in schema and "float scaling" in schema


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query": torch.zeros(2, 16)}, "query must be"),
        ({"bits": 5}, "bits must be 16, 8 or 4"),
        ({"block_table": torch.zeros(2, 3, dtype=torch.int64)}, "block_table must be"),
        ({"lengths": torch.zeros(3, dtype=torch.int32)}, "lengths must be"),
        ({"key_pool": torch.zeros(4, 8)}, "key_pool must be"),
        ({"tail_keys": torch.zeros(2, 1, 16)}, "come together"),
    ],
)
def test_bad_layouts_are_refused(change: dict[str, object], message: str) -> None:
    layout = random_layout([3, 4], seed=4)
    with pytest.raises(ValueError, match=message):
        ragged_decode(**{**layout.inputs, **change})
