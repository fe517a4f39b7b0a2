"""Quantized storage through ``torch.ops.criticalkv.ragged_decode``: its block table
(:func:`paged_quantized`) read by the op's C kernel (CPU) and its torch reference, against
dequantize-then-attend; the choice of kernel (``CRITICALKV_KERNEL``: ``c``, ``torch``) at the model
level and through ``generate``; threads that give the same bits; a struct of another layout refused.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from criticalkv.cache.quantized.code_blocks import empty_blocks, quantize_blocks, write_blocks
from criticalkv.cache.quantized.codec import value_group
from criticalkv.cache.quantized.paged import paged_quantized
from criticalkv.cache.quantized.prefix import QuantizedPrefix, build_quantized_prefix
from criticalkv.ops import ragged_decode, ragged_decode_reference
from criticalkv.ops.cpu import build, kernel
from tests.helpers.c_kernel import fresh_kernel_folder, needs_compiler
from tests.helpers.segment_attention import attend_segments


@pytest.fixture
def kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh kernel folder, so each test compiles (or fails to) on its own."""
    return fresh_kernel_folder(tmp_path, monkeypatch)


def _library() -> ctypes.CDLL:
    library = build.load_library()
    assert isinstance(library, ctypes.CDLL), library
    return library


def op_inputs(
    prefix: QuantizedPrefix,
    bits: int,
    group: int,
    d: int,
    query: torch.Tensor,
    tail: tuple[torch.Tensor, torch.Tensor] | None,
    mask: torch.Tensor | None,
) -> dict:
    """The op's arguments as the storage builds them: segments in sorted order, the dense tail."""
    pool = prefix.decode_pool()
    assert pool is not None
    paged = paged_quantized(prefix, pool, group)
    perm = prefix.perm
    return {
        "query": query[perm],
        "key_pool": pool.key_codes,
        "value_pool": pool.value_codes,
        "block_table": paged.table,
        "lengths": paged.lengths,
        "block_size": group,
        "scaling": d**-0.5,
        "tail_keys": None if tail is None else tail[0],
        "tail_values": None if tail is None else tail[1],
        "tail_mask": None if tail is None or mask is None else mask[perm],
        "bits": bits,
        "key_scale": pool.key_scale,
        "key_zero": pool.key_zero,
        "value_scale": pool.value_scale,
        "value_zero": pool.value_zero,
        "value_group": value_group(group, d),
        "entry_starts": paged.entry_starts,
    }


@needs_compiler
@settings(max_examples=120, deadline=None)
@given(
    bits=st.sampled_from([4, 8]),
    d=st.sampled_from([6, 8, 12, 16, 64]),
    group=st.sampled_from([1, 2, 3, 4, 6, 8, 16, 32, 64]),
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    length=st.integers(1, 80),
    queries=st.integers(1, 4),
    used=st.integers(0, 2),
    spare=st.integers(0, 2),
    residual=st.integers(0, 5),
    room=st.integers(0, 3),
    masked=st.booleans(),
    empty_row=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_op_over_the_block_table_matches_dequantize_then_attend(
    bits: int,
    d: int,
    group: int,
    batch: int,
    heads: int,
    length: int,
    queries: int,
    used: int,
    spare: int,
    residual: int,
    room: int,
    masked: bool,
    empty_row: bool,
    seed: int,
) -> None:
    """Ragged heads (random subsets: partial blocks of every length, empty heads), tail blocks with
    spare capacity, a residual buffer larger than its use, a tail mask with fully masked rows."""
    assume(not (d % group and group % d) and not (bits == 4 and d % 2))
    g = torch.Generator().manual_seed(seed)
    s = batch * heads
    keys = torch.randn(batch, heads, length, d, generator=g) * 3
    values = torch.randn(batch, heads, length, d, generator=g)
    keep = torch.rand(batch, heads, length, generator=g) < torch.rand(batch, heads, 1, generator=g)
    prefix = build_quantized_prefix(keys, values, keep, bits, group)
    assume(prefix.decode_pool() is not None)
    lengths = prefix.lengths.tolist()
    dense = prefix.dense(d, torch.float32)
    inv = prefix.inv_perm
    tail, tail_kv = None, None
    if used:
        tk, tv = torch.randn(s, used * group, d, generator=g), torch.randn(s, used * group, d, generator=g)
        tail = empty_blocks(s, used + spare, d, bits, group, torch.device("cpu"))
        write_blocks(tail, 0, quantize_blocks(tk, tv, bits, group))  # sorted order, as the layer appends
        k_all, v_all = tail.dequantize(0, used, torch.float32)
        tail_kv = (k_all[inv], v_all[inv])
    res_k = torch.randn(s, residual + room, d, generator=g)  # sorted order, capacity beyond its use
    res_v = torch.randn(s, residual + room, d, generator=g)
    query = torch.randn(s, queries, d, generator=g)
    t = used * group + residual
    mask = None
    if masked and t:
        mask = torch.rand(s, queries, t, generator=g) < 0.6
        if empty_row:
            mask[0, 0] = False
    scaling = d**-0.5
    residual_kv = (res_k[inv, :residual], res_v[inv, :residual])
    expected = attend_segments(query, dense, lengths, tail_kv, residual_kv, mask, scaling)
    sorted_tail = None  # what the storage passes: the quantized blocks dequantized, then the residual
    if used or residual:
        parts = [tail.dequantize(0, used, torch.float32)] if used and tail is not None else []
        parts.append((res_k[:, :residual], res_v[:, :residual]))
        sorted_tail = (torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1))
    inputs = op_inputs(prefix, bits, group, d, query, sorted_tail, mask)
    got = ragged_decode(**inputs)[inv]
    reference = ragged_decode_reference(**inputs)[inv]
    assert torch.allclose(got, expected, atol=2e-5, rtol=1e-4), (got - expected).abs().max()
    assert torch.allclose(reference, expected, atol=2e-5, rtol=1e-4), (reference - expected).abs().max()


def test_the_block_table_covers_every_stored_entry_once() -> None:
    """Each sorted segment's blocks hold exactly its kept entries, each pool entry owned by one block."""
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 3, 70, 8, generator=g), torch.randn(2, 3, 70, 8, generator=g)
    keep = torch.rand(2, 3, 70, generator=g) < torch.tensor([0.1, 0.5, 0.9]).view(1, 3, 1)
    prefix = build_quantized_prefix(keys, values, keep, 4, 8)
    pool = prefix.decode_pool()
    assert pool is not None
    paged = paged_quantized(prefix, pool, 8)
    owned = torch.zeros(int(pool.key_codes.shape[0]), dtype=torch.long)
    blocks: list[int] = []
    for s in range(6):
        length = int(paged.lengths[s])
        assert length == int(prefix.lengths[prefix.perm[s]])
        for j in range(-(-length // 8)):
            b = int(paged.table[s, j])
            start = int(paged.entry_starts[b])
            owned[start : start + min(8, length - j * 8)] += 1
            blocks.append(b)
    assert torch.equal(owned, torch.ones_like(owned))
    assert sorted(blocks) == list(range(int(pool.key_scale.shape[0])))


@pytest.fixture
def count_c_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How often the op's CPU implementation runs the C kernel."""
    calls: list[int] = []
    real = kernel.c_ragged_decode

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel, "c_ragged_decode", spy)
    return calls


@needs_compiler
@pytest.mark.parametrize("choice", ["c", "torch"])
@pytest.mark.parametrize(("method", "bits"), [("adakv", 4), ("snapkv", 4), ("critical-adakv", 8)])
@torch.no_grad()
def test_both_kernels_match_the_model_level_oracle(
    choice: str, method: str, bits: int, monkeypatch: pytest.MonkeyPatch, count_c_calls: list[int]
) -> None:
    """Batch 2 with padding, a padded 5-token append (several queries, a tail mask), decode steps
    past the residual (tail blocks): logits equal the quantize-dequantize reference either way."""
    from tests.cache.quantized.test_quantized_oracle import run_against_reference

    monkeypatch.setenv("CRITICALKV_KERNEL", choice)
    for arch in ("llama", "qwen2"):
        worst = run_against_reference(arch, method, bits, torch.device("cpu"))
        assert worst < 1e-4, f"{choice} kernel, {method} on {arch}, {bits} bits: logits differ by {worst}"
    assert (len(count_c_calls) > 0) == (choice == "c")


@needs_compiler
@torch.no_grad()
def test_generate_at_4_bits_is_the_same_through_either_kernel(
    monkeypatch: pytest.MonkeyPatch, count_c_calls: list[int]
) -> None:
    import criticalkv as ckv
    from tests.conftest import make_tiny
    from tests.helpers.tiny_tokenizer import char_tokenizer

    context = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 3
    tiny, tokenizer = make_tiny("mistral"), char_tokenizer()
    kwargs = {"window": 4, "max_new_tokens": 12, "chat": False, "method": "adakv", "budget": 0.4}
    answers = {}
    for choice in ("torch", "c"):
        monkeypatch.setenv("CRITICALKV_KERNEL", choice)
        result = ckv.generate(
            tiny, tokenizer, [context, context[:120]], ["Who?", "What jumps?"], kv_bits=4, kv_group_size=8, **kwargs
        )
        answers[choice] = result.answers
    assert count_c_calls
    assert answers["c"] == answers["torch"]


@needs_compiler
def test_threads_share_the_work_and_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work items are shared among torch's threads (OpenMP); each item is one thread's and the
    merge runs in a fixed order, so the result does not depend on the thread count, bit for bit."""
    monkeypatch.setenv("CRITICALKV_KERNEL", "c")
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(3, 4, 700, 16, generator=g), torch.randn(3, 4, 700, 16, generator=g)
    keep = torch.rand(3, 4, 700, generator=g) < torch.rand(3, 4, 1, generator=g)
    prefix = build_quantized_prefix(keys, values, keep, 4, 8)
    tail = (torch.randn(12, 5, 16, generator=g), torch.randn(12, 5, 16, generator=g))
    inputs = op_inputs(prefix, 4, 8, 16, torch.randn(12, 3, 16, generator=g), tail, None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ragged_decode(**inputs)
        torch.set_num_threads(2)
        two = ragged_decode(**inputs)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_compiler
def test_a_struct_of_another_layout_is_refused_not_read(kernel_cache: Path) -> None:
    from criticalkv.ops.cpu.args import DecodeArgs

    library = _library()
    assert int(library.ckv_decode_args_size()) == ctypes.sizeof(DecodeArgs)
    args = DecodeArgs(size=ctypes.sizeof(DecodeArgs) - 8)  # every pointer NULL: a read would crash
    assert library.ckv_ragged_decode(ctypes.byref(args)) == -2
