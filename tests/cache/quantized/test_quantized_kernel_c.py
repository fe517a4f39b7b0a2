"""The compiled C decode kernel over quantized storage against the torch kernel and a reference.

The reference dequantizes every stored entry (:meth:`QuantizedPrefix.dense`,
:meth:`QuantizedBlocks.dequantize`), appends the residual and runs one softmax per segment; the
torch kernel (:func:`quantized_attention`) is the other reading of the same storage. Plus the
choice of kernel: ``CRITICALKV_KERNEL=auto`` without a compiler falls back with one warning,
``=c`` without one raises, ``=torch`` never compiles, and the end-to-end generation path.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from criticalkv.cache.quantized.attention import quantized_attention
from criticalkv.cache.quantized.blocks import empty_blocks, quantize_blocks, write_blocks
from criticalkv.cache.quantized.kernels import build
from criticalkv.cache.quantized.kernels.quantized_decode import block_list, c_quantized_attention
from criticalkv.cache.quantized.plan import plan
from criticalkv.cache.quantized.prefix import build_quantized_prefix
from tests.helpers.segment_attention import attend_segments

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler (cc or gcc) on PATH"
)


@pytest.fixture
def kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh kernel folder, so each test compiles (or fails to) on its own."""
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CRITICALKV_KERNEL", raising=False)
    monkeypatch.setattr(build, "_chosen", {})
    return tmp_path / "kernels"


def _library() -> ctypes.CDLL:
    library = build.load_library()
    assert isinstance(library, ctypes.CDLL), library
    return library


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
def test_c_kernel_matches_torch_kernel_and_dequantize_then_attend(
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
    lengths = prefix.lengths.tolist()
    dense = prefix.dense(d, torch.float32)
    perm, inv = prefix.perm, prefix.inv_perm
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
    pool = prefix.decode_pool()
    got = c_quantized_attention(
        _library(),
        query,
        None if prefix.identity else perm,
        pool,
        block_list(prefix, pool, group),
        tail,
        used,
        res_k,
        res_v,
        residual,
        mask,
        scaling,
        bits,
        group,
    )
    torch_kernel = quantized_attention(
        query[perm],
        pool,
        plan(prefix, pool, group, used, residual + room),
        tail,
        res_k[:, :residual],
        res_v[:, :residual],
        None if mask is None else mask[perm],
        scaling,
        bits,
        group,
    )[inv]
    assert torch.allclose(got, expected, atol=2e-5, rtol=1e-4), (got - expected).abs().max()
    assert torch.allclose(got, torch_kernel, atol=2e-5, rtol=1e-4), (got - torch_kernel).abs().max()


@needs_compiler
def test_block_list_covers_every_stored_entry_once() -> None:
    """Each segment's blocks hold exactly its kept entries, each pool entry owned by one block."""
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 3, 70, 8, generator=g), torch.randn(2, 3, 70, 8, generator=g)
    keep = torch.rand(2, 3, 70, generator=g) < torch.tensor([0.1, 0.5, 0.9]).view(1, 3, 1)
    prefix = build_quantized_prefix(keys, values, keep, 4, 8)
    pool = prefix.decode_pool()
    assert pool is not None
    blocks = block_list(prefix, pool, 8)
    owned = torch.zeros(int(pool.key_codes.shape[0]), dtype=torch.long)
    for s in range(6):
        a, b = int(blocks.offsets[s]), int(blocks.offsets[s + 1])
        assert int(blocks.length[a:b].sum()) == int(prefix.lengths[prefix.perm[s]])
        for k in range(a, b):
            owned[int(blocks.entry[k]) : int(blocks.entry[k] + blocks.length[k])] += 1
    assert torch.equal(owned, torch.ones_like(owned))
    assert sorted(blocks.row.tolist()) == list(range(int(pool.key_scale.shape[0])))


@needs_compiler
def test_compiled_once_into_the_cache_folder(kernel_cache: Path) -> None:
    """The library lands in the kernel folder, named by a hash, and a second load reuses it."""
    first = build.load_library()
    assert isinstance(first, ctypes.CDLL)
    built = list(kernel_cache.glob("quantized_decode-*.so"))
    assert len(built) == 1 and not list(kernel_cache.glob("*.tmp*"))
    assert build.load_library() is first
    assert build.decode_kernel() is first


def test_no_compiler_auto_falls_back_with_one_warning(
    kernel_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(build, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.decode_kernel() is None
        assert build.decode_kernel() is None
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "/nonexistent/cc" in warnings[0].getMessage()


def test_no_compiler_with_kernel_c_raises_an_actionable_error(
    kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("CRITICALKV_KERNEL", "c")
    with pytest.raises(build.KernelUnavailable, match="Install a C compiler"):
        build.decode_kernel()


def test_a_failing_compile_falls_back(
    kernel_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that exits non-zero: auto warns with its complaint, nothing is left behind."""
    fake = tmp_path / "broken-cc"
    fake.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(build, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.decode_kernel() is None
    assert any("broken compiler" in r.getMessage() for r in caplog.records)
    assert not list(kernel_cache.glob("*"))


def test_kernel_torch_never_compiles(kernel_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRITICALKV_KERNEL", "torch")
    assert build.decode_kernel() is None
    assert not kernel_cache.exists()


def test_a_bad_kernel_choice_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRITICALKV_KERNEL", "fast")
    with pytest.raises(ValueError, match="auto, c, torch"):
        build.kernel_mode()


@pytest.fixture
def count_c_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How often the quantized layers call the C kernel."""
    from criticalkv.cache.quantized import storage as quantized_layer

    calls: list[int] = []
    real = quantized_layer.c_quantized_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(quantized_layer, "c_quantized_attention", spy)
    return calls


@needs_compiler
@pytest.mark.parametrize("kernel", ["c", "torch"])
@pytest.mark.parametrize(("method", "bits"), [("adakv", 4), ("snapkv", 4), ("critical-adakv", 8)])
@torch.no_grad()
def test_both_kernels_match_the_model_level_oracle(
    kernel: str, method: str, bits: int, monkeypatch: pytest.MonkeyPatch, count_c_calls: list[int]
) -> None:
    """Batch 2 with padding, a padded 5-token append (several queries, a tail mask), decode steps
    past the residual (tail blocks): logits equal the quantize-dequantize reference either way."""
    from tests.cache.quantized.test_quantized_oracle import run_against_reference

    monkeypatch.setenv("CRITICALKV_KERNEL", kernel)
    for arch in ("llama", "qwen2"):
        worst = run_against_reference(arch, method, bits, torch.device("cpu"))
        assert worst < 1e-4, f"{kernel} kernel, {method} on {arch}, {bits} bits: logits differ by {worst}"
    assert (len(count_c_calls) > 0) == (kernel == "c")


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
    for kernel in ("torch", "c"):
        monkeypatch.setenv("CRITICALKV_KERNEL", kernel)
        result = ckv.generate(
            tiny, tokenizer, [context, context[:120]], ["Who?", "What jumps?"], kv_bits=4, kv_group_size=8, **kwargs
        )
        answers[kernel] = result.answers
    assert count_c_calls
    assert answers["c"] == answers["torch"]


def _layout(seed: int, batch: int = 2, heads: int = 3, length: int = 70) -> dict:
    """A ragged quantized prefix, its pool and block list, a residual and queries (4 bits, group 8)."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (
        torch.randn(batch, heads, length, 16, generator=g),
        torch.randn(batch, heads, length, 16, generator=g),
    )
    keep = torch.rand(batch, heads, length, generator=g) < torch.rand(batch, heads, 1, generator=g)
    prefix = build_quantized_prefix(keys, values, keep, 4, 8)
    pool = prefix.decode_pool()
    s = batch * heads
    res = torch.randn(s, 5, 16, generator=g), torch.randn(s, 5, 16, generator=g)
    return {
        "query": torch.randn(s, 3, 16, generator=g),
        "perm": None if prefix.identity else prefix.perm,
        "pool": pool,
        "blocks": block_list(prefix, pool, 8),
        "residual": res,
    }


def _c_call(layout: dict) -> torch.Tensor:
    return c_quantized_attention(
        _library(), layout["query"], layout["perm"], layout["pool"], layout["blocks"], None, 0,
        *layout["residual"], 4, None, 0.25, 4, 8,
    )  # fmt: skip


@needs_compiler
def test_threads_share_the_segments_and_give_the_same_bits() -> None:
    """Segments are split among torch's threads (OpenMP); each segment is one thread's, so the
    result does not depend on the thread count, bit for bit."""
    layout = _layout(seed=5, batch=3, heads=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _c_call(layout)
        torch.set_num_threads(2)
        two = _c_call(layout)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_compiler
def test_a_struct_of_another_layout_is_refused_not_read() -> None:
    from criticalkv.cache.quantized.kernels.args import DecodeArgs

    library = _library()
    assert int(library.ckv_decode_args_size()) == ctypes.sizeof(DecodeArgs)
    args = DecodeArgs(size=ctypes.sizeof(DecodeArgs) - 8)  # every pointer NULL: a read would crash
    assert library.ckv_quantized_decode(ctypes.byref(args)) == -2


@needs_compiler
@pytest.mark.parametrize(("bits", "group", "length", "d"), [(4, 8, 900, 16), (8, 64, 1300, 16), (4, 3, 700, 12)])
def test_long_segments_are_split_among_items_and_merged_exactly(bits: int, group: int, length: int, d: int) -> None:
    """Segments longer than one work item (256 entries) are cut into several (split-K, so threads
    share one long head); their partial softmaxes merge into the same attention as the reference,
    with tail blocks, a residual and a mask that hides every tail column of one row."""
    g = torch.Generator().manual_seed(group)
    b, h, used, residual = 1, 3, 2, 4
    s = b * h
    keys, values = torch.randn(b, h, length, d, generator=g) * 3, torch.randn(b, h, length, d, generator=g)
    keep = torch.rand(b, h, length, generator=g) < torch.tensor([0.9, 0.5, 0.05]).view(1, 3, 1)
    prefix = build_quantized_prefix(keys, values, keep, bits, group)
    tail = empty_blocks(s, used + 1, d, bits, group, torch.device("cpu"))
    tk, tv = torch.randn(s, used * group, d, generator=g), torch.randn(s, used * group, d, generator=g)
    write_blocks(tail, 0, quantize_blocks(tk, tv, bits, group))
    k_all, v_all = tail.dequantize(0, used, torch.float32)
    inv = prefix.inv_perm
    res_k, res_v = torch.randn(s, residual + 2, d, generator=g), torch.randn(s, residual + 2, d, generator=g)
    query = torch.randn(s, 3, d, generator=g)
    mask = torch.rand(s, 3, used * group + residual, generator=g) < 0.7
    mask[1, 2] = False
    expected = attend_segments(
        query, prefix.dense(d, torch.float32), prefix.lengths.tolist(), (k_all[inv], v_all[inv]),
        (res_k[inv, :residual], res_v[inv, :residual]), mask, d**-0.5,
    )  # fmt: skip
    pool = prefix.decode_pool()
    got = c_quantized_attention(
        _library(), query, None if prefix.identity else prefix.perm, pool, block_list(prefix, pool, group),
        tail, used, res_k, res_v, residual, mask, d**-0.5, bits, group,
    )  # fmt: skip
    assert int(prefix.lengths.max()) > 2 * 256  # the longest head really is cut
    assert torch.allclose(got, expected, atol=2e-5, rtol=1e-4), (got - expected).abs().max()
