"""Building and choosing the op's C kernel (``criticalkv.ops.cpu.build``): compiled once into the
cache folder; without a compiler ``auto`` falls back with one warning and ``c`` raises an
actionable error; a failing compiler leaves nothing behind; ``torch`` never compiles; a bad
``CRITICALKV_KERNEL`` is a clear error."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest

from criticalkv.ops.cpu import build
from tests.helpers.c_kernel import fresh_kernel_folder, needs_compiler


@pytest.fixture
def kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh kernel folder, so each test compiles (or fails to) on its own."""
    return fresh_kernel_folder(tmp_path, monkeypatch)


@needs_compiler
def test_compiled_once_into_the_cache_folder(kernel_cache: Path) -> None:
    """The library lands in the kernel folder, named by a hash, and a second load reuses it."""
    first = build.load_library()
    assert isinstance(first, ctypes.CDLL)
    built = list(kernel_cache.glob("ragged_decode-*.so"))
    assert len(built) == 1 and not list(kernel_cache.glob("*.tmp*"))
    assert build.load_library() is first
    assert build.decode_kernel() is first


def test_no_compiler_auto_falls_back_with_one_warning(
    kernel_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    build.forget()
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
    build.forget()
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


def test_without_a_compiler_decode_runs_on_the_reference_with_one_warning(
    kernel_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The whole 4-bit generation path on a machine with no compiler: answers, one warning."""
    import criticalkv as ckv
    from tests.conftest import make_tiny
    from tests.helpers.tiny_tokenizer import char_tokenizer

    monkeypatch.setenv("CC", "/nonexistent/cc")
    build.forget()
    context = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 2
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        result = ckv.generate(
            make_tiny("llama"), char_tokenizer(), [context], ["Who?"], method="adakv", budget=0.4, window=4,
            max_new_tokens=6, chat=False, kv_bits=4, kv_group_size=8,
        )  # fmt: skip
    assert len(result.answers) == 1
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "torch reference" in warnings[0].getMessage()
