"""The compiled-kernel cache trusts nothing it did not build (issue 30, hostile inputs).

Each test plants what a hostile or unlucky machine leaves in ``$CRITICALKV_CACHE_DIR/kernels``: a
foreign library under the kernel's file name, a truncated one, a folder that cannot be written (or
a file where the folder should be), files writable by others, a symbolic link, and the command line
with ``CRITICALKV_KERNEL=c`` and no compiler. Each docstring says what the code before this change
did with it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from criticalkv.ops import ragged_decode_reference
from criticalkv.ops.cpu import build, c_ragged_decode
from criticalkv.ops.cpu.args import DecodeArgs
from tests.helpers.c_kernel import needs_compiler
from tests.helpers.ragged_layouts import random_layout

ROOT = Path(__file__).resolve().parents[2]
as_root = os.geteuid() == 0

#: a library with the kernel's symbols and struct size that fills the output with 1234
FOREIGN = """
#include <stdint.h>
int64_t ckv_decode_args_size(void) { return ARGS_SIZE; }
int ckv_ragged_decode(char *args) {
    int64_t s = *(int64_t *)(args + S_AT), q = *(int64_t *)(args + Q_AT), d = *(int64_t *)(args + D_AT);
    float *out = *(float **)(args + OUT_AT);
    for (int64_t i = 0; i < s * q * d; i++) out[i] = 1234.0f;
    return 0;
}
"""


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh ``CRITICALKV_CACHE_DIR`` (its kernel folder is returned, not yet created) and
    fresh per-process caches of the build module."""
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CRITICALKV_KERNEL", raising=False)
    build.forget()
    yield tmp_path / "cache" / "kernels"
    build.forget()  # the next test looks again, under its own environment


def _real_kernel(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The real kernel, built in its own cache folder ``scratch`` (the environment is restored)."""
    with monkeypatch.context() as local:
        local.setenv("CRITICALKV_CACHE_DIR", str(scratch))
        library = build.load_library()
        assert isinstance(library, ctypes.CDLL), library
    (built,) = (scratch / "kernels").glob("ragged_decode-*.so")
    return built


def _decode_both(library: ctypes.CDLL | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One 4-bit decode through ``library`` (``None``: skipped) and through the torch reference."""
    layout = random_layout([40, 20, 9], queries=2, block_size=8, tail=2, bits=4, seed=7, compact=True)
    expected = ragged_decode_reference(**layout.inputs)
    if library is None:
        return None, expected
    return c_ragged_decode(library, **layout.inputs), expected


#: run in a child process, where a bad library can crash only the child: decode once, report as JSON
PROBE = """
import json
from criticalkv.ops.cpu import build
from tests.ops.test_kernel_cache_trust import _decode_both
library = build.decode_kernel()
got, expected = _decode_both(library)
diff = None if got is None else float((got - expected).abs().max())
print(json.dumps({"loaded": library is not None, "diff": diff}))
"""


def _probe(cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """:data:`PROBE` in a fresh interpreter with ``CRITICALKV_CACHE_DIR=cache``."""
    source = Path(build.__file__).parents[3]  # the criticalkv this process imported, and these tests
    environment = {**os.environ, "CRITICALKV_CACHE_DIR": str(cache), "PYTHONPATH": f"{source}{os.pathsep}{ROOT}"}
    environment.pop("CRITICALKV_KERNEL", None)
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env={**environment, **env}
    )


@needs_compiler
def test_a_build_records_its_digest_and_keeps_the_folder_private(kernels: Path) -> None:
    """The folder is the user's alone, the library not writable by others, its sha256 recorded.

    Before: no record was written (``FileNotFoundError`` on ``.so.sha256``) and the folder took the
    umask's mode."""
    assert isinstance(build.load_library(), ctypes.CDLL)
    (library,) = kernels.glob("ragged_decode-*.so")
    record = json.loads(Path(f"{library}.sha256").read_text())
    assert record["size"] == library.stat().st_size
    assert record["sha256"] == build.trust.file_digest(library)[0]
    assert kernels.stat().st_mode & 0o077 == 0
    assert library.stat().st_mode & 0o022 == 0
    assert sorted(p.name for p in kernels.iterdir()) == [library.name, f"{library.name}.sha256"]


@needs_compiler
def test_a_foreign_library_under_the_kernels_name_is_not_loaded(
    kernels: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A library exporting the kernel's symbols, planted under its file name, is deleted and the
    real kernel built in its place, with a warning naming the file.

    Before: it was loaded and run: every output was 1234 (the test's assertion on the result)."""
    name = _real_kernel(tmp_path / "scratch", monkeypatch).name
    source = tmp_path / "foreign.c"
    source.write_text(FOREIGN)
    kernels.mkdir(parents=True, mode=0o700)
    at = {f"{field.upper()}_AT": getattr(DecodeArgs, field).offset for field in ("S", "Q", "d", "out")}
    defines = [f"-D{key}={value}" for key, value in {"ARGS_SIZE": ctypes.sizeof(DecodeArgs), **at}.items()]
    compiler = build.find_compiler()
    assert compiler is not None
    planted = kernels / name
    subprocess.run([compiler, *defines, "-shared", "-fPIC", "-o", str(planted), str(source)], check=True)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        library = build.decode_kernel()
    got, expected = _decode_both(library)
    assert got is not None and torch.allclose(got, expected, atol=2e-5, rtol=1e-4), got
    assert any(str(planted) in r.getMessage() and "digest record" in r.getMessage() for r in caplog.records)
    assert Path(f"{planted}.sha256").exists()


@needs_compiler
def test_a_truncated_library_is_built_again_without_a_crash(
    kernels: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first half of the real kernel under its name, with its (now wrong) record.

    Before: the 4-bit decode died of a bus error (exit -7, SIGBUS)."""
    real = _real_kernel(tmp_path / "scratch", monkeypatch)
    kernels.mkdir(parents=True, mode=0o700)
    (kernels / real.name).write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    record = Path(f"{real}.sha256")
    if record.exists():  # the record of the whole file, which the half no longer matches
        shutil.copy(record, kernels / record.name)
    done = _probe(kernels.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.splitlines()[-1])
    assert answer["loaded"] and answer["diff"] < 1e-4
    assert f"not loading {kernels / real.name}" in done.stderr and "bytes, not the" in done.stderr


def _file_in_the_way(kernels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernels.parent.write_text("not a folder")


def _read_only(kernels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if as_root:
        pytest.skip("root writes into a read-only folder anyway")
    kernels.mkdir(parents=True, mode=0o500)


def _refuses_new_files(kernels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only folder as the code meets it, for runs as root (who may write anywhere)."""
    kernels.mkdir(parents=True, mode=0o700)

    def refuse(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(13, "Permission denied", str(kernels))

    monkeypatch.setattr(build.tempfile, "mkstemp", refuse)


@needs_compiler
@pytest.mark.parametrize("setup", [_file_in_the_way, _read_only, _refuses_new_files])
def test_an_unwritable_cache_folder_falls_back_or_is_one_sentence(
    setup: Callable[[Path, pytest.MonkeyPatch], None],
    kernels: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``auto``: the torch kernel and one warning naming the folder; ``c``: ``KernelUnavailable``,
    one line naming the folder and ``CRITICALKV_CACHE_DIR``.

    Before: the ``OSError`` of ``mkdir`` or ``mkstemp`` (``NotADirectoryError``,
    ``PermissionError``) came out of the decode as a traceback, in either mode."""
    setup(kernels, monkeypatch)
    try:
        with caplog.at_level(logging.WARNING, logger=build.__name__):
            assert build.decode_kernel() is None
            assert build.decode_kernel() is None
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and str(kernels) in warnings[0] and "CRITICALKV_CACHE_DIR" in warnings[0]
        monkeypatch.setenv("CRITICALKV_KERNEL", "c")
        with pytest.raises(build.KernelUnavailable) as raised:
            build.decode_kernel()
        message = str(raised.value)
        assert str(kernels) in message and "CRITICALKV_CACHE_DIR" in message and "\n" not in message
    finally:
        if kernels.is_dir():
            kernels.chmod(0o700)


def _writable_by(bits: int, which: str) -> Callable[[Path], str]:
    def tamper(library: Path) -> str:
        path = library if which == "library" else library.parent
        path.chmod(path.stat().st_mode | bits)
        return f"chmod go-w {path}"

    return tamper


def _symlinked(library: Path) -> str:
    copy = library.parent.parent / "elsewhere.so"
    shutil.copy(library, copy)
    library.unlink()
    library.symlink_to(copy)
    return "symbolic link"


def _another_users(which: str) -> Callable[[Path], str]:
    def tamper(library: Path) -> str:
        if not as_root:
            pytest.skip("giving a file to another user needs root")
        path = library if which == "library" else library.parent
        os.chown(path, 65534, 65534)
        return "belongs to user id 65534"

    return tamper


@needs_compiler
@pytest.mark.parametrize(
    "tamper",
    [
        _writable_by(0o020, "library"),
        _writable_by(0o002, "library"),
        _writable_by(0o020, "folder"),
        _writable_by(0o002, "folder"),
        _symlinked,
        _another_users("library"),
        _another_users("folder"),
    ],
    ids=["library-g+w", "library-o+w", "folder-g+w", "folder-o+w", "symlink", "library-owner", "folder-owner"],
)
def test_a_library_or_folder_others_can_change_is_refused(
    tamper: Callable[[Path], str], kernels: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel built here, then made writable by group or others, replaced by a symbolic link, or
    given to another user: refused (``auto``: the torch kernel and a warning saying what to run;
    ``c``: ``KernelUnavailable`` with the same sentence), and left where it is.

    Before: it was loaded as it was (``decode_kernel()`` returned the library)."""
    assert isinstance(build.load_library(), ctypes.CDLL)
    (library,) = kernels.glob("ragged_decode-*.so")
    fix = tamper(library)
    build.forget()
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.decode_kernel() is None
    assert any(fix in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    build.forget()
    monkeypatch.setenv("CRITICALKV_KERNEL", "c")
    with pytest.raises(build.KernelUnavailable, match=fix):
        build.decode_kernel()
    assert os.path.lexists(library)


def test_the_command_line_says_kernel_c_is_unavailable_in_one_line(
    kernels: Path, tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``criticalkv generate --kv-bits 4`` with ``CRITICALKV_KERNEL=c`` and ``CC=/nonexistent``: one
    ``criticalkv: error:`` line, exit status 2.

    Before: ``KernelUnavailable`` (a ``RuntimeError``) escaped ``main`` as a traceback (exit 1)."""
    from criticalkv.cli import main

    monkeypatch.setenv("CRITICALKV_KERNEL", "c")
    monkeypatch.setenv("CC", "/nonexistent")
    context = tmp_path / "context.txt"
    context.write_text("The quick brown fox jumps over the lazy dog. The cat sleeps in the sun. " * 2)
    argv = ["generate", "--model", str(tiny_folder), "--context-file", str(context), "--question", "Who?"]
    argv += ["--kv-bits", "4", "--kv-group-size", "8", "--window", "4", "--max-new-tokens", "2", "--no-chat"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("criticalkv: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "CRITICALKV_KERNEL=c" in errors[0] and "CC=/nonexistent" in errors[0] and "Install a C compiler" in errors[0]


@needs_compiler
def test_a_damaged_library_in_a_folder_that_cannot_be_changed_is_refused(
    kernels: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel whose bytes no longer match its record, in a folder where it cannot be deleted
    (read-only; as root, where nothing is read-only, deleting there fails instead): not loaded, the
    torch kernel and one warning that names the file, why, and the folder.

    Before: it was loaded as it was (``decode_kernel()`` returned the library)."""
    assert isinstance(build.load_library(), ctypes.CDLL)
    (library,) = kernels.glob("ragged_decode-*.so")
    changed = kernels / "changed"
    changed.write_bytes(library.read_bytes()[:-1] + b"\x01")
    changed.chmod(0o700)
    changed.replace(library)  # a new inode: the library this process has loaded is left as it is
    build.forget()
    if as_root:
        real = os.unlink

        def refuse(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
            if Path(path).parent == kernels:
                raise PermissionError(13, "Permission denied", str(path))
            real(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "unlink", refuse)
    else:
        kernels.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING, logger=build.__name__):
            assert build.decode_kernel() is None
    finally:
        kernels.chmod(0o700)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"{library} was not loaded: its sha256 differs" in warning and "cannot be written" in warning
