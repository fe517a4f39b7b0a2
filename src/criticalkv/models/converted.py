"""The converted default model in the cache: checked on every load, rebuilt when damaged.

Each load checks the folder cheaply: the source record parses, every file it lists has the size
recorded when it was written, and every safetensors file is as long as its header says (a
folder converted by an older version, whose record lists no files, has every JSON file parsed
instead, and then gets its files recorded). A file's sha256 is computed only when its modification time differs from the
recorded one, when the environment variable :data:`VERIFY_ENV` is set (``1``), or when loading
the folder failed. A damaged folder is moved into a staging folder and rebuilt from the GGUF
file, with a warning naming what was wrong; all of that under the cache's build lock, so two
processes never rebuild at once.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from criticalkv.models.default_model import _SOURCE_FILE, _convert_default_model, _file_records, _write_source
from criticalkv.models.integrity import _folder_problems, _record_problems, _safetensors_problem
from criticalkv.models.paths import _DEFAULT_MODEL_NAME, ModelCacheError, cache_dir, default_model_dir
from criticalkv.models.staging import _build_lock, _staging, clean_stale

logger = logging.getLogger(__name__)

VERIFY_ENV = "CRITICALKV_VERIFY_CACHE"
"""Set to ``1`` to check the sha256 of every converted file on each load (about 1 s more)."""


def _full_check_requested() -> bool:
    return os.environ.get(VERIFY_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _read_source(path: Path) -> dict[str, Any] | None:
    """The source record at ``path``, or ``None`` if it is not one (unreadable, not an object)."""
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("model") != _DEFAULT_MODEL_NAME:
        return None
    return record


def _try_write_source(folder: Path, record: dict[str, Any], why: str) -> None:
    """Rewrite the source record, or leave it if the cache is read-only (the check still passed)."""
    try:
        _write_source(folder, record)
    except OSError as error:
        logger.debug("could not update %s (%s): %s", folder / _SOURCE_FILE, why, error)
        return
    logger.info("updated %s: %s", folder / _SOURCE_FILE, why)


def _converted_problems(folder: Path, *, full: bool) -> list[str]:
    """What is wrong with the converted default model in ``folder``; empty if it is intact.

    Parameters
    ----------
    folder : Path
        The converted model's folder (it must exist).
    full : bool
        Check every file's sha256, not only sizes and structure.

    Returns
    -------
    list of str
        One sentence per problem, each naming the file.
    """
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    source = _read_source(folder / _SOURCE_FILE)
    if source is None:
        return [f"{_SOURCE_FILE} is missing or unreadable (an incomplete or damaged conversion)"]
    files = source.get("files")
    if not isinstance(files, dict):  # converted by a version that recorded no sizes or checksums
        problems = _folder_problems(folder)
        if not problems:
            _try_write_source(folder, {**source, "files": _file_records(folder)}, "recorded sizes and checksums")
        return problems
    problems, rehashed = _record_problems(folder, files, full=full)
    if not problems:  # the record vouches for the JSON files; the weights' header is cheap to check too
        found = (_safetensors_problem(path) for path in sorted(folder.glob("*.safetensors")))
        problems = [problem for problem in found if problem is not None]
    if not problems and rehashed:  # copied or touched, contents intact: record the new times
        _try_write_source(folder, {**source, "files": _file_records(folder)}, "files were intact, times updated")
    return problems


def _discard(target: Path) -> None:
    """Move a damaged ``target`` into a staging folder, which is then deleted."""
    try:
        with _staging("damaged") as scratch:
            os.rename(target, scratch / target.name)
    except OSError as error:
        raise ModelCacheError(
            f"the converted default model in {target} is damaged and could not be removed ({error}); delete "
            "that folder yourself, or set CRITICALKV_CACHE_DIR to a writable folder, and load it again."
        ) from error


def _ensure_default_model(*, full: bool | None = None) -> Path:
    """The converted default model's folder: checked, rebuilt if damaged, converted on first use.

    Parameters
    ----------
    full : bool, optional
        Check every file's sha256; default: only if :data:`VERIFY_ENV` is set.

    Returns
    -------
    Path
        :func:`~criticalkv.models.default_model_dir`, holding an intact checkpoint.
    """
    clean_stale()
    target = default_model_dir()
    full = _full_check_requested() if full is None else full
    present = target.exists() or target.is_symlink()
    if present and not _converted_problems(target, full=full):
        return target
    try:
        with _build_lock(_DEFAULT_MODEL_NAME):
            if target.exists() or target.is_symlink():
                problems = _converted_problems(target, full=full)  # another process may have rebuilt it meanwhile
                if not problems:
                    return target
                logger.warning(
                    "the converted default model in %s is damaged (%s); rebuilding it from the GGUF file",
                    target, "; ".join(problems),
                )  # fmt: skip
                _discard(target)
            _convert_default_model(target)
    except OSError as error:  # a full disk, a read-only cache: nothing half-written is left
        raise ModelCacheError(
            f"could not write the default model into the cache folder {cache_dir()} ({error}). Free some space "
            "there (the conversion needs about 700 MB) or set CRITICALKV_CACHE_DIR to a writable folder, then "
            "load it again."
        ) from error
    return target


def _is_damaged(folder: Path) -> bool:
    """Whether a full check (every sha256) finds anything wrong with the converted folder."""
    problems = _converted_problems(folder, full=True) if folder.exists() else ["missing"]
    return bool(problems)
