"""What the compiled-kernel cache trusts: only libraries this code built and recorded.

A compiled library is native code run inside the process, so a file in the kernel folder is loaded
only when all of these hold (checked before :func:`ctypes.CDLL`, never after):

- the kernel folder is a folder owned by the current user that no one else can write (created with
  mode ``0o700``);
- the library is a regular file (not a symbolic link) owned by the current user, not writable by
  group or others, and so is its digest record ``<library>.sha256``;
- the library's size and sha256 equal those in its digest record, which the build wrote (atomically,
  before the library was renamed into place) from the bytes the compiler produced.

A file that fails the last rule (no record, truncated, replaced, damaged) is deleted and built again
with one warning; one that fails the others is refused with a sentence saying what to run, since
deleting what another user owns or a link points at is not this code's call.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: the digest record of ``x.so`` is ``x.so.sha256``
RECORD_SUFFIX = ".sha256"


@dataclass(frozen=True)
class Verdict:
    """Whether a library may be loaded; if not, why, and whether building it again is the fix."""

    ok: bool
    reason: str = ""  # empty with ``rebuild``: the library is simply not there yet
    rebuild: bool = False


LOADABLE = Verdict(True)


def record_path(library: Path) -> Path:
    """The digest record of ``library``."""
    return library.with_name(library.name + RECORD_SUFFIX)


def ownership_problem(path: Path, what: str, follow: bool = False) -> str | None:
    """``None`` when ``path`` is owned by the current user and not group/world-writable (and, unless
    ``follow``, not a symbolic link); else a sentence naming it and what to run."""
    info = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return f"{what} {path} is a symbolic link, which the kernel cache does not follow: delete it (rm {path})"
    if info.st_uid != os.getuid():
        return (
            f"{what} {path} belongs to user id {info.st_uid}, not to you (user id {os.getuid()}): delete it "
            "or set CRITICALKV_CACHE_DIR to a folder of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.filemode(info.st_mode)
        return f"{what} {path} can be written by other users (mode {mode}): run chmod go-w {path}"
    return None


def folder_problem(folder: Path) -> str | None:
    """``None`` when ``folder`` is a folder of the current user's that no one else can write, else why not."""
    if not folder.is_dir():
        return f"the kernel folder {folder} is not a folder: delete it or set CRITICALKV_CACHE_DIR elsewhere"
    return ownership_problem(folder, "the kernel folder", follow=True)


def unwritable(folder: Path, error: OSError, refused: str = "") -> str:
    """The sentence for a kernel folder that cannot be created or written (``refused``: why the file
    there could not be used, when one was there)."""
    why = error.strerror or str(error)
    if error.filename and str(error.filename) != str(folder):
        why = f"{why}: {error.filename}"
    head = f"{refused}, and it cannot be built again: " if refused else ""
    if isinstance(error, (NotADirectoryError, FileExistsError)):
        return (
            f"{head}the kernel folder {folder} cannot be created ({why}; part of its path is a file): "
            "set CRITICALKV_CACHE_DIR to a folder"
        )
    return (
        f"{head}the kernel folder {folder} cannot be written ({why}): make it writable "
        "or set CRITICALKV_CACHE_DIR to a writable folder"
    )


def file_digest(path: Path) -> tuple[str, int]:
    """The sha256 (hex) and size of the file at ``path``, read without following a symbolic link."""
    digest, size = hashlib.sha256(), 0
    handle = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(handle, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def write_record(built: Path, library: Path) -> None:
    """Record ``built``'s sha256 and size as the digest of ``library`` (which ``built`` is about to
    become), written to a temporary file and renamed into place."""
    sha256, size = file_digest(built)
    handle, temp = tempfile.mkstemp(suffix=".tmp", dir=library.parent)  # mode 0o600
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump({"sha256": sha256, "size": size}, file)
        os.replace(temp, record_path(library))
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _recorded(record: Path) -> tuple[str, int] | None:
    """The (sha256, size) a digest record holds, ``None`` if it is not one."""
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
        return str(data["sha256"]), int(data["size"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def verify(library: Path) -> Verdict:
    """Whether ``library`` (in a folder :func:`folder_problem` accepts) may be loaded (module docstring)."""
    if not os.path.lexists(library):
        return Verdict(False, rebuild=True)
    problem = ownership_problem(library, "the compiled kernel")
    if problem is None and not stat.S_ISREG(os.lstat(library).st_mode):
        problem = f"the compiled kernel {library} is not a regular file: delete it"
    if problem is not None:
        return Verdict(False, problem)
    record = record_path(library)
    if not os.path.lexists(record):
        return Verdict(False, f"it has no digest record ({record.name}), so this code did not build it", True)
    problem = ownership_problem(record, "the kernel's digest record")
    if problem is not None:
        return Verdict(False, problem)
    expected = _recorded(record)
    if expected is None:
        return Verdict(False, f"its digest record {record.name} cannot be read", True)
    sha256, size = file_digest(library)
    if size != expected[1]:
        return Verdict(False, f"it has {size} bytes, not the {expected[1]} recorded when it was built", True)
    if sha256 != expected[0]:
        return Verdict(False, "its sha256 differs from the one recorded when it was built", True)
    return LOADABLE


def discard(library: Path) -> None:
    """Delete ``library`` and its digest record (either may be missing)."""
    for path in (library, record_path(library)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive OS lock on ``folder`` itself (no lock file is left behind), so one process at
    a time checks, deletes and builds there; the kernel drops it if the process dies."""
    handle = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # closing releases the lock
