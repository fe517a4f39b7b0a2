"""Files the commands read and folders they write, checked before any model is loaded.

Each problem a user causes (a folder given as a file, a file that is not UTF-8, an output folder
that is a file) is a :class:`UsageError` naming the path and what to do, not a traceback.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from criticalkv.commands.common import UsageError


def read_text_file(path: Path, option: str) -> str:
    """The UTF-8 text of ``path`` given as ``option`` (e.g. ``--context-file``)."""
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder; give the text file itself")
    if not path.exists():
        raise UsageError(f"{option} {path} does not exist")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UsageError(f"{option} {path} cannot be read: {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise UsageError(
            f"{option} {path} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start} (line {line}) "
            f"is {err.reason}; save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8.txt`)"
        ) from None


def output_folder(path: Path, option: str) -> Path:
    """Check that ``path`` (given as ``option``) is or can become a writable folder; returns it."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} is a file, not a folder; give a folder name (it is created if missing)")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing != path and not existing.is_dir():
        raise UsageError(f"{option} {path}: {existing} is a file, so the folder cannot be created inside it")
    if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: {existing} is not writable; choose another folder")
    return path


def add_head_scores_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--head-scores",
        type=Path,
        default=None,
        metavar="FILE",
        help="head-score file for headkv / critical-headkv (default: the model's own; see `criticalkv head-scores`)",
    )


def check_head_scores(path: Path | None) -> Path | None:
    """Read and check a ``--head-scores`` file up front (its fit to the model is checked at binding)."""
    if path is None:
        return None
    from criticalkv.headscores.file import load_head_scores

    if path.is_dir():
        raise UsageError(f"--head-scores {path} is a folder; give the JSON file `criticalkv head-scores --out` wrote")
    load_head_scores(path)  # ValueError with the file's name and what is wrong
    return path
