"""The tiled quantized decode attention equals dequantize-then-attend.

The kernel (gathered prefix slots, partial blocks padded and masked, the quantized tail, the
full-precision residual, codes unpacked in halves, scores and values as batched products per
tile) against the straightforward reference: every segment's stored entries dequantized
(:meth:`QuantizedPrefix.dense`, :meth:`QuantizedBlocks.dequantize`), the residual appended,
one softmax per segment, times the values.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from criticalkv.cache.quantized import plan as quantized_plan
from criticalkv.cache.quantized.attention import quantized_attention, unpack
from criticalkv.cache.quantized.blocks import QuantizedBlocks, empty_blocks, quantize_blocks, write_blocks
from criticalkv.cache.quantized.plan import plan
from criticalkv.cache.quantized.prefix import build_quantized_prefix
from tests.helpers.segment_attention import attend_segments


@settings(max_examples=80, deadline=None)
@given(
    bits=st.sampled_from([4, 8]),
    d=st.sampled_from([8, 12, 16]),
    group=st.sampled_from([2, 3, 4, 6, 8, 16, 32]),
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    length=st.integers(1, 50),
    queries=st.integers(1, 3),
    used=st.integers(0, 2),
    residual=st.integers(0, 5),
    masked=st.booleans(),
    tile=st.sampled_from([1, 2, 3, 128]),
    seed=st.integers(0, 2**16),
)
def test_tiled_attention_matches_dequantize_then_attend(
    bits: int,
    d: int,
    group: int,
    batch: int,
    heads: int,
    length: int,
    queries: int,
    used: int,
    residual: int,
    masked: bool,
    tile: int,
    seed: int,
) -> None:
    """Ragged heads (each keeps a random subset: partial blocks of every length), any tile bound."""
    assume(not (d % group and group % d) and not (bits == 4 and d % 2))
    g = torch.Generator().manual_seed(seed)
    s = batch * heads
    keys = torch.randn(batch, heads, length, d, generator=g)
    values = torch.randn(batch, heads, length, d, generator=g)
    keep = torch.rand(batch, heads, length, generator=g) < torch.rand(batch, heads, 1, generator=g)
    prefix = build_quantized_prefix(keys, values, keep, bits, group)
    lengths = prefix.lengths.tolist()
    dense = prefix.dense(d, torch.float32)  # the reference reads the stored entries before pooling
    tail = None
    if used:
        tk, tv = torch.randn(s, used * group, d, generator=g), torch.randn(s, used * group, d, generator=g)
        tail = empty_blocks(s, used + 1, d, bits, group, torch.device("cpu"))  # spare capacity: strided reads
        write_blocks(tail, 0, quantize_blocks(tk, tv, bits, group))
    res = (torch.randn(s, residual, d, generator=g), torch.randn(s, residual, d, generator=g))
    query = torch.randn(s, queries, d, generator=g)
    mask = None
    if masked and used * group + residual:
        mask = torch.rand(s, queries, used * group + residual, generator=g) < 0.6
    tail_kv = tail.dequantize(0, used, torch.float32) if tail is not None and used else None
    expected = attend_segments(query, dense, lengths, tail_kv, res, mask, d**-0.5)
    pool = prefix.decode_pool()
    assert torch.equal(prefix.dense(d, torch.float32)[0], dense[0])  # pooling moved, did not change, the bytes
    old = quantized_plan.TILE_BLOCKS
    quantized_plan.TILE_BLOCKS = tile
    try:
        decode_plan = plan(prefix, pool, group, used, residual + 2)
    finally:
        quantized_plan.TILE_BLOCKS = old
    perm, inv = prefix.perm, prefix.inv_perm
    sorted_mask = None if mask is None else mask[perm]
    got = quantized_attention(
        query[perm],
        pool,
        decode_plan,
        tail if tail is None else _sorted(tail, perm),
        res[0][perm],
        res[1][perm],
        sorted_mask,
        d**-0.5,
        bits,
        group,
    )[inv]
    assert torch.allclose(got, expected, atol=2e-5, rtol=1e-4), (got - expected).abs().max()
    for t in decode_plan.tiles:  # the workspace is bounded by a tile (or one segment)
        assert (t.last - t.first) * (t.nbp + used) <= max(tile, t.nbp + used)


def _sorted(tail: QuantizedBlocks, perm: torch.Tensor) -> QuantizedBlocks:
    """The tail in sorted segment order (the layer appends in that order)."""
    parts = [p[perm] for p in tail.parts()]
    return QuantizedBlocks(*parts, None, tail.bits, tail.group)  # type: ignore[call-arg]


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_in_halves_is_exact(bits: int) -> None:
    """Every byte unpacks to its codes: channel 2j + h at half h, position j (4 bits)."""
    codes = torch.arange(256, dtype=torch.uint8).view(1, 4, 64)
    halves = 2 if bits == 4 else 1
    out = torch.empty(halves, 1, 4, 64)
    unpack(codes, bits, out)
    expected = codes.float()[None] if bits == 8 else torch.stack([(codes & 15).float(), (codes >> 4).float()])
    assert torch.equal(out, expected)
