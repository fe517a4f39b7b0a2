"""Compile the C decode kernel once per machine and load it with :mod:`ctypes`.

Why not ``torch.utils.cpp_extension``: the kernel is plain C (no torch headers), so a compile
takes well under a second, where an extension compiled against torch's C++ headers takes tens of
seconds on two cores and needs ninja; and the extension cache loads whatever library it finds under
its name, while this one loads only what it built (issue 30's planted-kernel case). The op's typed
face is the schema of ``torch.ops.criticalkv.ragged_decode``; this module only supplies its CPU body.

The shared library goes into ``$CRITICALKV_CACHE_DIR/kernels`` (default ``~/.cache/criticalkv/kernels``,
or under ``$XDG_CACHE_HOME``), named by a hash of the source, the compiler, its flags and the
machine (its architecture and CPU flags, as ``-march=native`` code only runs where it was built),
written to a temporary file and renamed into place, so concurrent processes never load a partial
file. ``$CC`` names the compiler (default ``cc``, then ``gcc``). Nothing there is loaded unless this
code built it: each library's sha256 is recorded beside it and checked before loading, and the
folder and files must be the user's own (:mod:`.trust`); a foreign, damaged or truncated library
is built again with a warning, and a folder that cannot be written means the op's torch reference.

``CRITICALKV_KERNEL`` chooses: ``auto`` (the default: the C kernel where it builds, else one
logged warning and the torch reference), ``c`` (the C kernel or an error saying why not), ``torch``
(never compile; the torch reference).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from criticalkv.ops.cpu import trust
from criticalkv.ops.cpu.args import DecodeArgs

logger = logging.getLogger(__name__)

#: environment variable choosing the decode kernel: auto, c or torch
KERNEL_ENV = "CRITICALKV_KERNEL"
KERNEL_MODES = ("auto", "c", "torch")
#: flags tried in order: tuned to this CPU, then portable
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"),  # threads over segments (OpenMP)
    ("-O3", "-fopenmp", "-shared", "-fPIC"),
    ("-O3", "-march=native", "-shared", "-fPIC"),  # a compiler without OpenMP: one thread
    ("-O3", "-shared", "-fPIC"),
)

#: how the reason for a missing compiler starts
NO_COMPILER = "no C compiler found"

_loaded: dict[tuple[str, str, str], ctypes.CDLL | str] = {}  # (compiler, source hash, folder) -> library or why not


def bind_decode(library: ctypes.CDLL) -> ctypes.CDLL | str:
    """Type ``ckv_ragged_decode``'s one argument (a pointer to :class:`DecodeArgs`) after checking
    that the library lays the struct out as this module does; else a sentence saying it does not."""
    size = library.ckv_decode_args_size
    size.argtypes, size.restype = [], ctypes.c_int64
    if int(size()) != ctypes.sizeof(DecodeArgs):
        return f"the compiled kernel's argument struct has {int(size())} bytes, not {ctypes.sizeof(DecodeArgs)}"
    function = library.ckv_ragged_decode
    function.argtypes, function.restype = [ctypes.POINTER(DecodeArgs)], ctypes.c_int
    return library


class KernelUnavailable(RuntimeError, ValueError):
    """``CRITICALKV_KERNEL=c`` was asked for and the C kernel cannot be built or loaded.

    Also a :class:`ValueError`: the fix is a setting the user controls (``CRITICALKV_KERNEL``,
    ``CC``, the cache folder), so the command line prints it as one error line, not a traceback."""


def kernel_mode() -> str:
    """``CRITICALKV_KERNEL``, checked: ``auto`` (unset), ``c`` or ``torch``."""
    mode = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNEL_ENV} must be one of {', '.join(KERNEL_MODES)}, not {mode!r}")
    return mode


def kernel_dir() -> Path:
    """Where compiled kernels are kept (see the module docstring)."""
    explicit = os.environ.get("CRITICALKV_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "criticalkv" / "kernels"
    return Path.home() / ".cache" / "criticalkv" / "kernels"


def find_compiler() -> str | None:
    """``$CC`` if set (a path or a name on ``PATH``), else ``cc`` or ``gcc``; ``None`` if none is found."""
    wanted = os.environ.get("CC")
    for name in [wanted] if wanted else ["cc", "gcc"]:
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.splitlines()[0] if done.stdout else ""


def _run_compiler(compiler: str, flags: tuple[str, ...], source: Path, output: str) -> str | None:
    """Run the compiler once; ``None`` on success, else its complaint."""
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", output, str(source), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return str(error)
    if done.returncode == 0:
        return None
    return (done.stderr or done.stdout).strip()[-2000:] or "the compiler failed without a message"


def _compile(compiler: str, source: Path, target: Path) -> str | None:
    """Compile ``source`` into ``target`` atomically, its digest recorded first (:mod:`.trust`);
    ``None`` on success, else the compiler's complaint. Raises ``OSError`` if the folder cannot be
    written."""
    complaint = ""
    for flags in FLAG_SETS:
        handle, temp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
        try:
            complaint = _run_compiler(compiler, flags, source, temp) or ""
            if not complaint:
                os.chmod(temp, 0o700)  # the user's alone, whatever the umask
                trust.write_record(Path(temp), target)
                os.replace(temp, target)
                return None
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
    return complaint


def _prepare(compiler: str, source: Path, target: Path) -> str | None:
    """Make ``target`` a library this code built and recorded (building it, or deleting a foreign or
    damaged one and building it again, under the folder's lock); ``None`` once it is, else why not."""
    folder = target.parent
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        return trust.unwritable(folder, error)
    problem = trust.folder_problem(folder)
    if problem is not None:
        return problem
    verdict = trust.verify(target)
    if verdict.ok or not verdict.rebuild:
        return verdict.reason or None
    refused = f"{target} was not loaded: {verdict.reason}" if verdict.reason else ""
    try:
        with trust.folder_lock(folder):
            verdict = trust.verify(target)  # another process may have built it meanwhile
            if verdict.ok or not verdict.rebuild:
                return verdict.reason or None
            if verdict.reason:
                trust.discard(target)
                logger.warning("not loading %s: %s; building it again", target, verdict.reason)
            complaint = _compile(compiler, source, target)
    except OSError as error:
        return trust.unwritable(folder, error, refused)
    if complaint is not None:
        return f"compiling {source.name} with {compiler} into {folder} failed: {complaint}"
    verdict = trust.verify(target)
    return None if verdict.ok else f"{target} is not the library just built: {verdict.reason}"


@functools.cache
def _source(name: str) -> tuple[Path, bytes]:
    """The kernel's source file and its bytes (read once per process)."""
    source = Path(str(resources.files("criticalkv.ops.cpu").joinpath(f"{name}.c")))
    return source, source.read_bytes()


def load_library(name: str = "ragged_decode") -> ctypes.CDLL | str:
    """The compiled kernel library ``name`` (``kernels/<name>.c``), building it if needed, or a
    sentence saying why it is not available. Cached per compiler, source and folder."""
    compiler = find_compiler()
    if compiler is None:
        wanted = os.environ.get("CC")
        why = f"CC={wanted} is not an executable" if wanted else "neither cc nor gcc is on PATH"
        return f"{NO_COMPILER} ({why}): install gcc or set CC to one"
    source, code = _source(name)
    folder = kernel_dir()
    key = (compiler, hashlib.sha256(code).hexdigest(), str(folder))
    if key in _loaded:
        return _loaded[key]
    fingerprint = hashlib.sha256(
        b"\0".join(
            [
                code,
                compiler.encode(),
                _compiler_version(compiler).encode(),
                repr(FLAG_SETS).encode(),
                platform.machine().encode(),
                _cpu_flags().encode(),
            ]
        )
    ).hexdigest()[:20]
    target = folder / f"{name}-{fingerprint}.so"
    result: ctypes.CDLL | str
    problem = _prepare(compiler, source, target)
    if problem is not None:
        _loaded[key] = problem
        return problem
    try:
        library = ctypes.CDLL(str(target))
        result = bind_decode(library)
    except (OSError, AttributeError) as error:
        result = f"loading {target} failed: {error} (delete the file to rebuild it)"
    _loaded[key] = result
    return result


_warned: set[str] = set()
_chosen: dict[tuple[str | None, ...], ctypes.CDLL | str] = {}  # environment -> load_library()'s answer


def forget() -> None:
    """Forget the libraries this process loaded, the kernel it chose and the warnings it gave, as a
    fresh process would (the next :func:`decode_kernel` looks again)."""
    _loaded.clear()
    _chosen.clear()
    _warned.clear()


def decode_kernel() -> ctypes.CDLL | None:
    """The C decode kernel to use, per ``CRITICALKV_KERNEL``: the library, or ``None`` for the
    op's torch reference (``auto`` logs one warning per reason when the C kernel cannot be had).

    Raises
    ------
    KernelUnavailable
        ``CRITICALKV_KERNEL=c`` and the kernel cannot be built or loaded.
    """
    mode = kernel_mode()
    if mode == "torch":
        return None
    setting = tuple(os.environ.get(name) for name in ("CC", "CRITICALKV_CACHE_DIR", "XDG_CACHE_HOME", "HOME", "PATH"))
    library = _chosen.get(setting)
    if library is None:  # per call is a dictionary look-up: no file or PATH search
        library = _chosen[setting] = load_library()
    if isinstance(library, ctypes.CDLL):
        return library
    if mode == "c":
        raise KernelUnavailable(
            f"{KERNEL_ENV}=c but the C decode kernel is unavailable: {library}. "
            f"{'Install a C compiler (gcc)' if library.startswith(NO_COMPILER) else 'Fix that'}, "
            f"or set {KERNEL_ENV}=auto or torch to use the torch reference."
        )
    if library not in _warned:
        _warned.add(library)
        logger.warning("the C decode kernel is unavailable, using the torch reference: %s", library)
    return None
