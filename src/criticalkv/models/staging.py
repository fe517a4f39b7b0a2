"""Temporary files and locks in the cache folder: staging folders, the build lock, stale clean-up.

Every temporary file that fetching or converting the default model writes lives in a staging
folder ``cache_dir() / "staging" / "<purpose>-<pid>-<random>"``, never in the system temp
folder. Its owner holds an OS lock on ``<folder>.lock`` (taken before the folder exists) for as
long as it works in it, and removes both on the way out, on success or failure. A process killed
outright (``SIGKILL``, out of memory) cannot clean up, but the OS frees its lock, so the next
start finds the folder unlocked and removes it (:func:`clean_stale`). Files left by older
versions (no lock file) are removed once they are older than :data:`STALE_AFTER_S`.

:func:`_build_lock` serialises fetching and converting across processes: two processes never
convert at once, and the second one then finds the first one's result.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from filelock import FileLock, Timeout

from criticalkv.models.paths import _DEFAULT_MODEL_NAME, ModelCacheError, cache_dir

logger = logging.getLogger(__name__)

STALE_AFTER_S = 10 * 60
"""Age after which an unlocked leftover without a lock file of its own counts as stale."""

_BUILD_LOCK_TIMEOUT_S = 30 * 60
"""How long to wait for another process that is fetching or converting the default model."""

_LOCK_SUFFIX = ".lock"


def _staging_root() -> Path:
    """The folder that holds every staging folder: ``cache_dir() / "staging"``."""
    return cache_dir() / "staging"


def _lock_dir() -> Path:
    """The folder that holds the build locks: ``cache_dir() / "locks"``."""
    return cache_dir() / "locks"


def _remove(path: Path) -> None:
    """Delete a file or folder tree; a missing path is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(FileNotFoundError):
            path.unlink()


@contextmanager
def _staging(purpose: str) -> Iterator[Path]:
    """A fresh, locked staging folder in the cache; removed with its lock on the way out.

    Parameters
    ----------
    purpose : str
        A short word that goes into the folder's name (``"convert"``, ``"fetch"``), so a user
        who lists the staging folder sees what each one was for.

    Yields
    ------
    Path
        The empty folder. Move what should outlive it out of it (``os.replace``) before the
        block ends.
    """
    root = _staging_root()
    root.mkdir(parents=True, exist_ok=True)
    name = f"{purpose}-{os.getpid()}-{secrets.token_hex(4)}"
    folder, lock_path = root / name, root / (name + _LOCK_SUFFIX)
    lock = FileLock(str(lock_path))
    lock.acquire(timeout=0)  # the name is new, so nobody else holds it; taken before the folder exists
    try:
        folder.mkdir()
        yield folder
    finally:
        _remove(folder)
        _remove(lock_path)  # unlinked while still held, so no one can lock this inode later
        lock.release()


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except FileNotFoundError:
        return 0.0


def _remove_if_unlocked(entry: Path, lock_path: Path, *, require_age: bool) -> bool:
    """Remove ``entry`` (and its lock file) if no live process holds ``lock_path``."""
    if require_age and _age_s(entry) < STALE_AFTER_S:
        return False
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False  # a live process works in it
    except OSError as error:  # a read-only cache: nothing can be cleaned there
        logger.debug("cannot lock %s to clean up: %s", lock_path, error)
        return False
    try:
        _remove(entry)
        _remove(lock_path)
    except OSError as error:
        logger.debug("cannot remove %s: %s", entry, error)
        return False
    finally:
        lock.release()
    return True


def _legacy_leftovers() -> list[Path]:
    """Temporaries that versions before the staging folder left beside their targets or in /tmp."""
    found = list((cache_dir() / "models").glob(f".{_DEFAULT_MODEL_NAME}.tmp-*"))
    found += list((cache_dir() / "gguf").glob(".*.part"))
    found += list(Path(tempfile.gettempdir()).glob("criticalkv-wheel-*"))
    return found


def clean_stale() -> list[Path]:
    """Remove staging folders whose owner is gone and legacy leftovers older than the grace time.

    Returns
    -------
    list of Path
        What was removed (each one is also logged).
    """
    removed: list[Path] = []
    root = _staging_root()
    entries = sorted(root.iterdir()) if root.is_dir() else []
    names = {entry.name for entry in entries}
    for entry in entries:
        if entry.name.endswith(_LOCK_SUFFIX):
            owned = entry.name[: -len(_LOCK_SUFFIX)] in names
            # a lone lock file: its folder is gone; old enough, it is a leftover of a crash
            if not owned and _remove_if_unlocked(entry, entry, require_age=True):
                removed.append(entry)
            continue
        lock_path = root / (entry.name + _LOCK_SUFFIX)
        # with its lock file, a free lock proves the owner is dead; without, wait out the grace time
        if _remove_if_unlocked(entry, lock_path, require_age=entry.name + _LOCK_SUFFIX not in names):
            removed.append(entry)
    for leftover in _legacy_leftovers():
        if _age_s(leftover) >= STALE_AFTER_S:
            try:
                _remove(leftover)
            except OSError as error:  # e.g. another user's file in the shared temp folder
                logger.debug("cannot remove %s: %s", leftover, error)
                continue
            removed.append(leftover)
    for path in removed:
        logger.warning("removed %s, left behind by an interrupted download or conversion", path)
    return removed


@contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Hold the cache's lock for building ``name`` (fetch and convert), waiting for another holder."""
    folder = _lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name + _LOCK_SUFFIX)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("another process is fetching or converting %s; waiting for it (lock %s)", name, path)
        try:
            lock.acquire(timeout=_BUILD_LOCK_TIMEOUT_S)
        except Timeout as error:
            raise ModelCacheError(
                f"another process has held {path} for {_BUILD_LOCK_TIMEOUT_S // 60} minutes while fetching or "
                f"converting {name}. The OS frees that lock when the process ends, so one still runs: wait for "
                "it or stop it, then try again."
            ) from error
    try:
        yield
    finally:
        lock.release()
