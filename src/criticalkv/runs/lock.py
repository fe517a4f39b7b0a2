"""One writer per results folder: an OS file lock (``writer.lock``) held for the whole run.

The lock is ``fcntl``/``msvcrt`` based (the ``filelock`` package), so the operating system
releases it when the holder dies, even by ``SIGKILL``: a killed run never leaves a folder locked.
Beside it the holder keeps ``writer.json`` (pid, host, start time, command), so a second writer
can say who holds the folder.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_FILE = "writer.lock"
OWNER_FILE = "writer.json"

#: seconds a second writer waits for the folder by default before it refuses
DEFAULT_WAIT = 10.0


class FolderBusy(ValueError):
    """Another process holds the folder's writer lock (a ``ValueError``: the CLI prints its sentence)."""


def check_folder_path(out_dir: Path) -> Path:
    """``out_dir`` as a ``Path``; ``ValueError`` if it exists and is not a folder."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file, not a results folder; pass a folder path as --out")
    return out_dir


def _owner(out_dir: Path) -> str:
    """``"pid 123 on host h since t"`` of the recorded holder, or ``""`` if none is recorded."""
    try:
        info = json.loads((out_dir / OWNER_FILE).read_text())
        return f" (pid {info['pid']} on {info['host']}, since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


@contextmanager
def writer_lock(out_dir: Path, wait: float = DEFAULT_WAIT) -> Iterator[Path]:
    """Hold ``out_dir``'s writer lock (creating the folder) while the block runs.

    Parameters
    ----------
    out_dir : the results folder.
    wait : seconds to wait for another writer to finish (``0``: refuse at once; negative: wait
        as long as it takes).

    Raises
    ------
    FolderBusy
        If another process still holds the lock after ``wait`` seconds; the message names the
        folder and, where recorded, the holder's pid and host.
    """
    out_dir = check_folder_path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(out_dir / LOCK_FILE), timeout=wait)
    try:
        lock.acquire()
    except Timeout:
        raise FolderBusy(
            f"another process{_owner(out_dir)} is writing to {out_dir}; wait for it to finish (or pass "
            "--wait SECONDS to queue behind it), or use another --out"
        ) from None
    owner = out_dir / OWNER_FILE
    try:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv,
        }
        owner.write_text(json.dumps(info) + "\n")
        yield out_dir
    finally:
        owner.unlink(missing_ok=True)
        lock.release()
