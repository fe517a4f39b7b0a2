"""The built wheel carries what the installed library needs at run time: the C kernel's source,
compiled from the installed copy (not the checkout) on first use."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from criticalkv.ops.cpu.build import find_compiler

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_wheel_ships_the_kernel_source_and_it_compiles_from_there(tmp_path: Path) -> None:
    source = tmp_path / "src-copy"  # a copy: the build writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "*.egg-info", "demo-out"))
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    built = subprocess.run([*command, str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("criticalkv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "criticalkv/ops/cpu/ragged_decode.c" in names and "criticalkv/py.typed" in names
    if find_compiler() is None:
        pytest.skip("no C compiler here: the shipped source cannot be compiled")
    installed = tmp_path / "installed"
    zipfile.ZipFile(wheel).extractall(installed)
    cache = tmp_path / "kernel-cache"
    probe = (
        "import criticalkv.ops.cpu.build as b, pathlib; "
        f"assert pathlib.Path(b.__file__).is_relative_to(pathlib.Path(r'{installed}')), b.__file__; "
        "assert b.decode_kernel() is not None"
    )
    env = {**os.environ, "PYTHONPATH": str(installed), "CRITICALKV_CACHE_DIR": str(cache), "CRITICALKV_KERNEL": "c"}
    ran = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert list((cache / "kernels").glob("*.so")), sorted(p.name for p in cache.rglob("*"))
