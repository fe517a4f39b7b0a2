"""The Triton kernel of ``torch.ops.criticalkv.ragged_decode`` (``criticalkv.ops.triton_ragged``)
run through Triton's interpreter on CPU tensors, against the torch reference and the loop
reference of ``tests/helpers/ragged_layouts.py``: ragged lengths with 0- and 1-entry sequences,
GQA row counts 1, 3, 4 and 8, partial quantization blocks stored unpadded (``entry_starts``),
tails under masks with False, float32/bfloat16/float16, 16/8/4 bits, a head dimension that is no
power of two, one-entry blocks (the 16-bit tiers' layout), a long sequence over several splits,
NaN in every pool row no sequence owns, and a check that the lengths matter.

Why a subprocess: ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a kernel, that is
when ``criticalkv.ops.triton_ragged`` is first imported, and ``criticalkv.ops`` imports it on
every CUDA build of torch, so in a pytest process that imported criticalkv first the kernels are
compiled ones and cannot take CPU tensors. So the module-scoped fixture ``kernel`` runs this file
as a script (``python -m tests.ops.test_triton_ragged OUT``) with ``TRITON_INTERPRET=1`` in its
environment from the start: the script runs the kernel on every case of :data:`CASES` and saves
the outputs (or the error of a case that raised); each test here compares its cases with the
references in the pytest process. One process for the file: about 6 s of imports, then about
0.4 s a case on one core.

The interpreter ran every construct the kernel uses (runtime-bounded loops, a runtime branch on
the program id, ``tl.dot`` in float32 with ``input_precision="ieee"``, bfloat16 loads and stores,
uint8 nibble shifts): nothing is worked around. What it cannot check is compilation for a GPU
(``tl.dot``'s shape limits, registers): ``test_the_compiled_kernel_on_cuda`` runs the compiled
kernel through the op with ``pytest --device cuda`` (skipped on the CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from criticalkv.ops import ragged_decode_reference
from tests.helpers.ragged_layouts import Layout, loop_reference, poison_padding, random_layout

pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[2]


def _nothing_attended() -> Layout:
    """Sequence 0 has no entries and its tail is masked out for every row: zeros, not NaN."""
    layout = random_layout([0, 4, 1], queries=3, tail=2, seed=8)
    layout.inputs["tail_mask"][0] = False
    layout.inputs["tail_mask"][2, 1] = False
    return layout


def _lengths(layout: Layout, lengths: list[int]) -> Layout:
    """The same pool and table read to other lengths (only the torch reference knows the answer)."""
    return Layout(dict(layout.inputs, lengths=torch.tensor(lengths, dtype=torch.int32)), [], [])


def _sweep(seed: int) -> Layout:
    """A layout drawn at random (seeded): lengths 0-30, rows, block size, tail, bits, storage, dtype."""
    g = torch.Generator().manual_seed(seed)

    def pick(options: list[Any]) -> Any:
        return options[int(torch.randint(len(options), (1,), generator=g))]

    bits = pick([16, 8, 4])
    lengths = torch.randint(0, 31, (pick([1, 3, 5]),), generator=g).tolist()
    return random_layout(
        lengths,
        queries=pick([1, 3, 4, 8]),
        block_size=pick([1, 4, 8]),
        tail=pick([0, 1, 5]),
        bits=bits,
        dtype=pick([torch.float32, torch.float32, torch.bfloat16, torch.float16]),
        compact=bits != 16 and pick([True, False]),
        seed=seed,
    )


RAGGED = [0, 1, 5, 13, 8, 2]
#: the kernel's cases: name -> layout (each built the same way in the script and in the tests)
CASES: dict[str, Callable[[], Layout]] = {
    **{f"ragged-{b}bit": (lambda b=b: random_layout(RAGGED, bits=b, seed=b)) for b in (16, 8, 4)},
    **{
        f"gqa-{q}-{b}bit": (lambda q=q, b=b: random_layout([3, 0, 9, 1], queries=q, bits=b, tail=3, seed=q))
        for q, b in ((1, 16), (3, 8), (4, 4), (8, 16))
    },
    **{f"partial-{b}bit": (lambda b=b: random_layout([3, 9, 6, 0, 1], bits=b, seed=5, compact=True)) for b in (8, 4)},
    **{
        f"tail-{str(d).removeprefix('torch.')}": (lambda d=d: random_layout([7, 0, 1, 16], tail=3, dtype=d, seed=3))
        for d in (torch.float32, torch.bfloat16, torch.float16)
    },
    "tail-bfloat16-4bit": lambda: random_layout([6, 0, 10], tail=2, bits=4, dtype=torch.bfloat16, seed=6),
    "head-dim-24": lambda: random_layout([5, 11, 0], queries=3, head_dim=24, bits=4, tail=2, seed=7, compact=True),
    "one-entry-blocks": lambda: random_layout([0, 6, 1, 3], block_size=1, tail=2, seed=9),
    "long-4bit": lambda: random_layout([100, 3], queries=4, block_size=8, bits=4, tail=4, seed=10, compact=True),
    "long-16bit": lambda: random_layout([90, 0], queries=1, block_size=4, tail=3, seed=11),
    "nothing-attended": _nothing_attended,
    "poisoned-16bit": lambda: poison_padding(random_layout([5, 0, 3, 10], tail=2, seed=12)),
    "poisoned-4bit": lambda: poison_padding(random_layout([5, 1, 7], bits=4, seed=13, compact=True)),
    **{f"sweep-{i}": (lambda i=i: _sweep(100 + i)) for i in range(8)},
    "lengths-real": lambda: random_layout([5, 6], block_size=4, seed=1),
    "lengths-whole-blocks": lambda: _lengths(random_layout([5, 6], block_size=4, seed=1), [8, 8]),
}


def run_cases(path: str) -> None:
    """The script: every case through the kernel (the interpreter), saved to ``path``."""
    from criticalkv.ops import triton_ragged

    outputs: dict[str, torch.Tensor | str] = {"interpreted": str(triton_ragged.interpreted())}
    for name, make in CASES.items():
        try:
            outputs[name] = triton_ragged.triton_ragged_decode(**make().inputs)
        except Exception as error:  # one case's failure fails its test, not the others'
            outputs[name] = f"{type(error).__name__}: {error}"
    torch.save(outputs, path)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor | str]:
    """Every case's kernel output, computed by this file run as a script under the interpreter."""
    pytest.importorskip("triton")
    path = tmp_path_factory.mktemp("triton") / "outputs.pt"
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))
    command = [sys.executable, "-m", "tests.ops.test_triton_ragged", str(path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    outputs: dict[str, torch.Tensor | str] = torch.load(path)
    assert outputs.pop("interpreted") == "True"  # TRITON_INTERPRET=1 reached the kernels
    return outputs


def output(kernel: dict[str, torch.Tensor | str], name: str) -> torch.Tensor:
    got = kernel[name]
    assert isinstance(got, torch.Tensor), f"the kernel raised on {name}: {got}"
    return got


def check(kernel: dict[str, torch.Tensor | str], name: str, loop: bool = True) -> torch.Tensor:
    """The case's kernel output against the torch reference and (``loop``) the loop reference."""
    layout = CASES[name]()
    got, query = output(kernel, name), layout.inputs["query"]
    assert got.shape == query.shape and got.dtype == query.dtype and not got.isnan().any()
    tol = 1e-5 if query.dtype == torch.float32 else 2e-2
    if loop:
        torch.testing.assert_close(got.double(), loop_reference(layout), atol=tol, rtol=tol)
    if name.startswith("poisoned"):
        return got  # the torch reference reads a poisoned row 0 for the missing entries
    reference = ragged_decode_reference(**layout.inputs)
    torch.testing.assert_close(got.float(), reference.float(), atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith(("ragged", "gqa", "partial"))])
def test_ragged_lengths_gqa_rows_and_partial_blocks(kernel: dict[str, torch.Tensor | str], name: str) -> None:
    got = check(kernel, name)
    empty = CASES[name]().inputs["lengths"] == 0
    if "tail_keys" not in CASES[name]().inputs:
        assert (got[empty] == 0).all()  # a sequence with nothing to attend: zeros


@pytest.mark.parametrize(
    "name", [n for n in CASES if n.startswith(("tail", "sweep")) or n in ("head-dim-24", "one-entry-blocks")]
)
def test_tails_dtypes_and_shapes(kernel: dict[str, torch.Tensor | str], name: str) -> None:
    check(kernel, name)


def test_nothing_attended_gives_zeros(kernel: dict[str, torch.Tensor | str]) -> None:
    got = check(kernel, "nothing-attended")
    assert (got[0] == 0).all() and (got[2, 1] != 0).any()  # sequence 2 row 1 still sees its one entry


@pytest.mark.parametrize("name", ["long-4bit", "long-16bit"])
def test_a_long_sequence_over_several_splits(kernel: dict[str, torch.Tensor | str], name: str) -> None:
    from criticalkv.ops.triton_ragged import split_plan

    x = CASES[name]().inputs
    (s, _, d), capacity = x["query"].shape, int(x["block_table"].shape[1]) * x["block_size"]
    tile, per_split, splits = split_plan(s, capacity, d, x["query"].device)
    assert splits >= 3 and per_split * splits >= capacity and per_split % tile == 0
    check(kernel, name)


@pytest.mark.parametrize("name", ["poisoned-16bit", "poisoned-4bit"])
def test_each_sequence_is_read_only_to_its_length(kernel: dict[str, torch.Tensor | str], name: str) -> None:
    check(kernel, name)  # NaN in every row no sequence owns: reading one gives NaN


def test_the_kernel_masks_the_lengths(kernel: dict[str, torch.Tensor | str]) -> None:
    """A kernel that read whole blocks (dropped the length mask) would give the whole-block answer
    for the real lengths too: the two answers differ, and each case equals its reference."""
    real = check(kernel, "lengths-real")
    whole = check(kernel, "lengths-whole-blocks", loop=False)
    assert not torch.allclose(real, whole, atol=1e-3)


@pytest.mark.parametrize("name", ["gqa-4-4bit", "partial-8bit", "tail-bfloat16", "long-16bit", "nothing-attended"])
def test_the_compiled_kernel_on_cuda(device: torch.device, name: str) -> None:
    """With ``pytest --device cuda``: the op dispatches to the compiled kernel on CUDA tensors."""
    if device.type != "cuda":
        pytest.skip("the compiled Triton kernel runs on CUDA (pytest --device cuda)")
    pytest.importorskip("triton")
    from criticalkv.ops import decode_through_op

    layout = CASES[name]()
    moved: dict[str, Any] = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in layout.inputs.items()}
    got = torch.ops.criticalkv.ragged_decode(**moved).cpu()
    tol = 1e-5 if got.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), loop_reference(layout), atol=tol, rtol=tol)
    assert decode_through_op(device) or os.environ.get("CRITICALKV_DECODE") == "native"


if __name__ == "__main__":
    run_cases(sys.argv[1])
