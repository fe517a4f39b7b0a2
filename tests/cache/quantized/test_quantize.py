"""The quantization primitives: exact packing, the per-group error bound, the bytes formula."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from criticalkv.cache.quantized import KVQuantization, quantization_for
from criticalkv.cache.quantized.code_blocks import quantize_blocks
from criticalkv.cache.quantized.codec import dequantize, pack, quantize, unpack
from criticalkv.cache.quantized.prefix import build_quantized_prefix

BITS = st.sampled_from([4, 8])


@settings(max_examples=60, deadline=None)
@given(bits=BITS, rows=st.integers(1, 5), half=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_is_exact(bits: int, rows: int, half: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, 2 * half), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape[-1] == 2 * half * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


@settings(max_examples=80, deadline=None)
@given(
    bits=BITS,
    groups=st.integers(1, 6),
    size=st.integers(1, 40),
    scale=st.floats(1e-3, 1e3),
    offset=st.floats(-100, 100),
    seed=st.integers(0, 2**31 - 1),
)
def test_error_within_half_a_step_per_group(
    bits: int, groups: int, size: int, scale: float, offset: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(groups, size, generator=g) * scale + offset
    codes, s, z = quantize(x, bits, dim=-1)
    assert s.shape == z.shape == (groups, 1) and s.dtype == torch.float16
    assert int(codes.max()) <= 2**bits - 1
    back = dequantize(codes, s, z, torch.float32)
    bound = s.float() / 2 * (1 + 1e-5) + 1e-6 * x.abs().amax(-1, keepdim=True)
    assert bool(((back - x).abs() <= bound).all())
    # the step is no coarser than the range over the levels (up to float16 rounding); a group whose
    # values all equal its float16 zero point has scale 1 and codes 0 (any scale reads back exactly)
    spread = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2**bits - 1)
    flat = x.amax(-1, keepdim=True) == z.float()
    assert bool((codes[flat.expand_as(codes)] == 0).all()) and bool((s[flat] == 1).all())
    fine = s.float() <= spread * (1 + 2**-9) + 2**-24 + 2**-10 * x.abs().amax(-1, keepdim=True)
    assert bool((fine | flat).all())


def test_constant_group_is_exact_when_representable() -> None:
    x = torch.full((2, 8), 0.5)
    codes, s, z = quantize(x, 4, dim=-1)
    assert torch.equal(dequantize(codes, s, z, torch.float32), x)


@settings(max_examples=40, deadline=None)
@given(bits=BITS, seed=st.integers(0, 2**31 - 1), size=st.integers(2, 20))
def test_invalid_entries_do_not_move_the_statistics(bits: int, seed: int, size: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, size, generator=g)
    valid = torch.rand(3, size, generator=g) > 0.3
    valid[:, 0] = True
    poisoned = x.masked_fill(~valid, 1e4)
    _, s1, z1 = quantize(poisoned, bits, dim=-1, valid=valid)
    _, s2, z2 = quantize(x.masked_fill(~valid, 0.0), bits, dim=-1, valid=valid)
    assert torch.equal(s1, s2) and torch.equal(z1, z2)


@pytest.mark.parametrize("bits", [4, 8])
def test_block_bytes_equal_the_formula(bits: int) -> None:
    n, nb, group, d = 3, 5, 8, 16
    blocks = quantize_blocks(torch.randn(n, nb * group, d), torch.randn(n, nb * group, d), bits, group)
    entries = n * nb * group
    codes = 2 * entries * d * bits // 8
    key_stats = 2 * n * nb * d * 2  # scale + zero, float16, per channel per block
    value_stats = 2 * entries * (d // group) * 2  # scale + zero, float16, per token per channel group
    assert blocks.nbytes() == codes + key_stats + value_stats


def prefix_bytes(lengths: torch.Tensor, d: int, bits: int, group: int) -> int:
    """The bytes formula: whole blocks of ``group`` and each head's partial block at its real length."""
    gv = min(group, d)
    per_entry = 2 * d * bits // 8 + (d // gv) * 2 * 2  # key and value codes, value scale + zero
    per_block = d * 2 * 2  # key scale + zero, float16, per channel
    blocks = int((lengths // group).sum()) + int((lengths % group > 0).sum())
    return int(lengths.sum()) * per_entry + blocks * per_block


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (8, 64), (4, 128)])
def test_prefix_bytes_and_bits_per_element(bits: int, group: int) -> None:
    """Ragged heads: L // G whole blocks plus a partial block of L mod G entries, no padded code."""
    b, h, t, d = 2, 3, 300, 64
    g = torch.Generator().manual_seed(0)
    keep = torch.rand(b, h, t, generator=g) < torch.rand(b, h, 1, generator=g)
    keep[..., -4:] = True
    keep[0, 0, : 2 * group] = True  # one head of exactly whole blocks (no partial block)
    keep[0, 0, 2 * group :] = False
    prefix = build_quantized_prefix(torch.randn(b, h, t, d), torch.randn(b, h, t, d), keep, bits, group)
    lengths = keep.reshape(-1, t).sum(-1)
    assert prefix.partial is not None and int(prefix.partial.key_codes.shape[0]) == int((lengths % group).sum())
    assert prefix.nbytes() == prefix_bytes(lengths, d, bits, group)
    assert int(prefix.segment_bytes().sum()) == prefix.nbytes()
    if bits == 4 and group == 64:  # whole blocks: 4 + 0.5 (keys) + 0.5 (values) bits
        whole = torch.full((1, 1, 640), True)
        exact = build_quantized_prefix(torch.randn(1, 1, 640, d), torch.randn(1, 1, 640, d), whole, 4, 64)
        assert exact.partial is None and 8 * exact.nbytes() / (2 * 640 * d) == pytest.approx(4.5)


@settings(max_examples=40, deadline=None)
@given(
    bits=BITS,
    group=st.sampled_from([4, 8, 16, 32]),
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_partial_blocks_read_back_within_half_a_step(bits: int, group: int, lengths: list[int], seed: int) -> None:
    """Each head's kept entries read back in position order; the last L mod G are one group of
    exactly that many entries (key statistics over them alone), each within half a step."""
    t, d = 40, 16
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, len(lengths), t, d, generator=g) * 3, torch.randn(1, len(lengths), t, d, generator=g)
    keep = torch.zeros(1, len(lengths), t, dtype=torch.bool)
    for j, n in enumerate(lengths):
        keep[0, j, torch.randperm(t, generator=g)[:n]] = True
    prefix = build_quantized_prefix(keys, values, keep, bits, group)
    dense_k, dense_v = prefix.dense(d, torch.float32)
    assert prefix.nbytes() == prefix_bytes(keep[0].sum(-1), d, bits, group)
    for j, n in enumerate(lengths):
        kept_k, kept_v = keys[0, j, keep[0, j]], values[0, j, keep[0, j]]
        got_k, got_v = dense_k[j, :n], dense_v[j, :n]
        assert bool((dense_k[j, n:] == 0).all())
        for c in range(0, n, group):  # each group's own step bounds its error
            chunk = slice(c, min(n, c + group))
            step = (kept_k[chunk].amax(0) - kept_k[chunk].amin(0)) / (2**bits - 1)
            assert bool(((got_k[chunk] - kept_k[chunk]).abs() <= step / 2 * 1.01 + 1e-3).all())
        vstep = (kept_v.amax(-1, keepdim=True) - kept_v.amin(-1, keepdim=True)) / (2**bits - 1)
        assert bool(((got_v - kept_v).abs() <= vstep / 2 * 1.01 + 1e-3).all())


def test_prefix_reads_back_its_kept_entries() -> None:
    """The staircase gathers each head's kept entries in position order; the partial tile masks its padding."""
    b, h, t, d, group = 1, 4, 30, 8, 4
    keys = torch.randn(b, h, t, d)
    keep = torch.zeros(b, h, t, dtype=torch.bool)
    for j, n in enumerate([3, 9, 30, 13]):
        keep[0, j, torch.randperm(t)[:n]] = True
    prefix = build_quantized_prefix(keys, keys.clone(), keep, 8, group)
    for s in range(h):
        i = int(prefix.inv_perm[s])
        parts = []
        for tier in prefix.attention_blocks():
            if tier.num_segments > i:
                k, _ = tier.dequantize(0, tier.num_blocks, torch.float32)
                valid = tier.valid_columns(0, tier.num_blocks)
                parts.append(k[i] if valid is None else k[i, valid[i]])
        got = torch.cat(parts)
        assert got.shape[0] == int(keep[0, s].sum())
        assert torch.allclose(got, keys[0, s, keep[0, s]], atol=0.05)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_bits": 3}, "kv_bits must be 16"),
        ({"kv_bits": 2}, "kv_bits must be 16"),
        ({"kv_bits": 4, "group_size": 0}, "positive integer"),
        ({"kv_bits": 4, "residual": -1}, "non-negative"),
        ({"kv_bits": 4, "residual": 600, "budget": 512}, "longer than the budget"),
    ],
)
def test_bad_options(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantization_for(**kwargs)


def test_bad_types_and_head_dim() -> None:
    with pytest.raises(TypeError, match="kv_bits must be an integer"):
        quantization_for("4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not divide the head dimension 64"):
        KVQuantization(4, 48).check_head_dim(64)
    assert quantization_for(16) is None
