"""One bounds check for every implementation of ``ragged_decode`` (issue 41): a block table or
lengths reaching outside the pool are refused with the same sentence by the torch reference, the
C kernel and the Triton kernel (under Triton's interpreter it read past the pool: a segmentation
fault); the Triton kernel on CPU tensors without the interpreter is one sentence too ("0 active
drivers" before). The Triton cases run in a subprocess: ``triton.jit`` reads ``TRITON_INTERPRET``
when the module is imported (see tests/ops/test_triton_ragged.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from criticalkv.ops import ragged_decode, ragged_decode_reference
from criticalkv.ops.reference import OUTSIDE_POOL, reaches_outside_pool
from tests.helpers.ragged_layouts import random_layout

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import torch
from criticalkv.ops import triton_ragged
from tests.helpers.ragged_layouts import random_layout
layout = random_layout([5, 6], block_size=4, bits={bits}, seed=2, spare_blocks=0)
inputs = dict(layout.inputs)
{change}
try:
    triton_ragged.triton_ragged_decode(**inputs)
    print("RAN")
except ValueError as error:
    print("REFUSED:", error)
"""


def _tables() -> list[tuple[str, str]]:
    """(name, a change to the layout's inputs that reaches outside the pool)."""
    return [
        ("no such block", "t = inputs['block_table'].clone(); t[1, 1] = 99; inputs['block_table'] = t"),
        ("a hole the length uses", "t = inputs['block_table'].clone(); t[0, 1] = -1; inputs['block_table'] = t"),
        ("too long", "inputs['lengths'] = torch.tensor([9, 6], dtype=torch.int32)"),
        ("negative length", "inputs['lengths'] = torch.tensor([-1, 6], dtype=torch.int32)"),
    ]


def _run(script: str, interpret: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


def _apply(inputs: dict, change: str) -> dict:
    inputs = dict(inputs)
    exec(change, {"torch": torch, "inputs": inputs})  # the same change the subprocess makes
    return inputs


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize(("name", "change"), _tables())
def test_the_reference_and_the_c_kernel_refuse_alike(bits: int, name: str, change: str) -> None:
    layout = random_layout([5, 6], block_size=4, bits=bits, seed=2, spare_blocks=0)
    bad = _apply(layout.inputs, change)
    assert bool(reaches_outside_pool(bad["block_table"], bad["lengths"], 4, int(bad["key_pool"].shape[0])))
    for implementation in (ragged_decode_reference, ragged_decode):
        with pytest.raises(ValueError, match=OUTSIDE_POOL):
            implementation(**bad)
    good = layout.inputs
    assert not bool(reaches_outside_pool(good["block_table"], good["lengths"], 4, int(good["key_pool"].shape[0])))


@pytest.mark.triton
def test_the_triton_kernel_refuses_the_same_tables_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    script = "\n".join(SCRIPT.format(bits=8, change=change) for _, change in _tables())
    done = _run(script, interpret=True)
    assert done.returncode == 0, done.stderr[-2000:]  # a segmentation fault: -11
    assert done.stdout.splitlines() == [f"REFUSED: {OUTSIDE_POOL}"] * len(_tables())


@pytest.mark.triton
def test_the_triton_kernel_on_cpu_without_the_interpreter_is_one_sentence() -> None:
    pytest.importorskip("triton")
    done = _run(SCRIPT.format(bits=16, change=""), interpret=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("REFUSED: the Triton kernel runs on CUDA tensors, or on CPU tensors only under")
    assert "TRITON_INTERPRET=1" in done.stdout and "criticalkv.ops.ragged_decode" in done.stdout
