"""The C kernel as the CPU implementation of ``torch.ops.criticalkv.ragged_decode``
(``criticalkv.ops.cpu``): against the loop reference and the torch reference on random ragged
layouts (0- and 1-entry sequences, shuffled and unpadded partial blocks, 16/8/4 bits, tails with
masks and fully masked rows, GQA row counts, long sequences split over several work items),
with 1 and 2 threads; NaN in every pool row no sequence owns (a kernel reading past a length
gives NaN); a block table reaching outside the pool refused before anything is read; inputs it
does not take and ``CRITICALKV_KERNEL=torch`` answered by the torch reference."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import criticalkv.ops  # noqa: F401  (registers the op and its CPU implementation)
from criticalkv.ops import ragged_decode, ragged_decode_reference
from criticalkv.ops.cpu import build, kernel
from tests.helpers.ragged_layouts import loop_reference, poison_padding, random_layout

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler (cc or gcc) on PATH"
)


@pytest.fixture(autouse=True)
def kernel_folder(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One kernel folder for the module's tests, the C kernel required (a build failure fails)."""
    folder = tmp_path_factory.getbasetemp() / "cpu-kernel-cache"
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(folder))
    monkeypatch.setenv("CRITICALKV_KERNEL", "c")
    return folder


def calls_of_c(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time the C kernel runs."""
    calls: list[int] = []
    real = kernel.c_ragged_decode

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel, "c_ragged_decode", counted)
    return calls


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    queries=st.sampled_from([1, 3, 4, 8]),
    block_size=st.sampled_from([1, 4, 8]),
    tail=st.integers(0, 5),
    bits=st.sampled_from([16, 8, 4]),
    value_group=st.sampled_from([4, 8, 16]),
    compact=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 10_000),
)
def test_the_c_kernel_equals_the_references(
    lengths: list[int],
    queries: int,
    block_size: int,
    tail: int,
    bits: int,
    value_group: int,
    compact: bool,
    threads: int,
    seed: int,
) -> None:
    layout = random_layout(
        lengths,
        queries=queries,
        block_size=block_size,
        tail=tail,
        bits=bits,
        value_group=value_group,
        seed=seed,
        compact=compact and bits != 16,
    )
    if tail and seed % 3 == 0:
        layout.inputs["tail_mask"][0, 0] = False  # a row whose tail is masked out entirely
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ragged_decode(**poison_padding(layout).inputs)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.double(), loop_reference(layout), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, ragged_decode_reference(**layout.inputs), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bits", [16, 4])
def test_long_sequences_split_over_work_items(bits: int) -> None:
    """Sequences of 600 and 1300 entries are cut into several work items, merged exactly."""
    layout = random_layout([600, 3, 1300, 0], queries=3, block_size=8, tail=4, bits=bits, seed=5)
    torch.testing.assert_close(ragged_decode(**layout.inputs).double(), loop_reference(layout), atol=1e-5, rtol=1e-5)


def test_the_op_on_cpu_runs_the_c_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = calls_of_c(monkeypatch)
    ragged_decode(**random_layout([3, 5], bits=4, seed=1).inputs)
    assert calls == [1]


def test_a_table_reaching_outside_the_pool_is_refused() -> None:
    layout = random_layout([5, 6], block_size=4, bits=8, seed=2, spare_blocks=0)
    table = layout.inputs["block_table"].clone()
    table[1, 1] = 99  # no such block
    with pytest.raises(ValueError, match="outside the pool"):
        ragged_decode(**dict(layout.inputs, block_table=table))
    hole = layout.inputs["block_table"].clone()
    hole[0, 1] = -1  # a block the length reaches, missing
    with pytest.raises(ValueError, match="outside the pool"):
        ragged_decode(**dict(layout.inputs, block_table=hole))
    too_long = torch.tensor([9, 6], dtype=torch.int32)  # longer than its row of the table holds
    with pytest.raises(ValueError, match="outside the pool"):
        ragged_decode(**dict(layout.inputs, lengths=too_long))


def test_statistics_that_do_not_cover_the_pool_are_refused() -> None:
    layout = random_layout([5, 6], block_size=4, bits=4, seed=3)
    short = layout.inputs["value_scale"][:-1]
    with pytest.raises(ValueError, match="value_scale must be"):
        ragged_decode(**dict(layout.inputs, value_scale=short))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inputs_it_does_not_take_go_to_the_reference(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = calls_of_c(monkeypatch)
    layout = random_layout([7, 0, 1], tail=2, dtype=dtype, seed=4)
    with caplog.at_level(logging.INFO, logger="criticalkv.ops.cpu.kernel"):
        got = ragged_decode(**layout.inputs)
    assert calls == [] and got.dtype == dtype
    torch.testing.assert_close(got, ragged_decode_reference(**layout.inputs))
    kernel.forget()


def test_kernel_torch_never_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRITICALKV_KERNEL", "torch")
    monkeypatch.setattr(build, "load_library", lambda *_: pytest.fail("compiled under CRITICALKV_KERNEL=torch"))
    calls = calls_of_c(monkeypatch)
    layout = random_layout([4, 9], bits=8, seed=6)
    torch.testing.assert_close(ragged_decode(**layout.inputs), ragged_decode_reference(**layout.inputs))
    assert calls == []


@pytest.mark.parametrize("used", [1, 3])
def test_a_tail_that_is_a_slice_of_a_larger_buffer_is_read_in_place(used: int) -> None:
    """The storages pass ``buffer[:, :used]`` of a tail with spare capacity: read where it lies,
    never past ``used``; a tail with another memory layout (a transposed copy) is made dense."""
    layout = random_layout([6, 0, 9], queries=3, tail=used, bits=4, seed=9)
    x = layout.inputs
    s, _, d = x["tail_keys"].shape
    buffers = [torch.full((s, used + 4, d), float("nan")) for _ in range(2)]  # spare room: NaN if read
    for buffer, name in zip(buffers, ("tail_keys", "tail_values"), strict=True):
        buffer[:, :used] = x[name]
    sliced = dict(x, tail_keys=buffers[0][:, :used], tail_values=buffers[1][:, :used])
    assert not sliced["tail_keys"].is_contiguous() or used == 1
    expected = ragged_decode_reference(**x)
    torch.testing.assert_close(ragged_decode(**sliced), expected, atol=2e-5, rtol=2e-5)
    odd = {name: x[name].transpose(1, 2).contiguous().transpose(1, 2) for name in ("tail_keys", "tail_values")}
    torch.testing.assert_close(ragged_decode(**dict(x, **odd)), expected, atol=2e-5, rtol=2e-5)
