"""Checking checkpoint files for damage: cheap structural checks, sizes and checksums.

A safetensors file describes itself: an 8-byte header length, a JSON header, then the tensor
data, whose extent the header gives, so a truncated or padded file is found by reading the
header alone. :func:`_folder_problems` applies this (and JSON parsing of the config and index
files) to any checkpoint folder; :func:`_file_record` and :func:`_record_problems` compare files
with the sizes and sha256 digests recorded when they were written.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit on the header


def _sha256(path: Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file ``path`` is damaged, or ``None``; reads only its header."""
    size = path.stat().st_size
    if size < 8:
        return f"{path.name} is {size} bytes, too short for a safetensors file (truncated)"
    with path.open("rb") as handle:
        (header_bytes,) = struct.unpack("<Q", handle.read(8))
        if header_bytes > min(_MAX_HEADER_BYTES, size - 8):
            return f"{path.name} declares a {header_bytes}-byte header in a {size}-byte file (truncated or corrupted)"
        raw = handle.read(header_bytes)
    try:
        header = json.loads(raw)
        ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return f"{path.name} has an unreadable safetensors header (corrupted)"
    expected = 8 + header_bytes + max(ends, default=0)
    if size != expected:
        how = "truncated" if size < expected else "has trailing bytes"
        return f"{path.name} is {size} bytes but its header describes {expected} bytes ({how})"
    return None


def _json_problem(path: Path) -> str | None:
    """Why the JSON file ``path`` cannot be read, or ``None``."""
    try:
        json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as error:
        return f"{path.name} is not valid JSON ({error}; truncated or corrupted)"
    return None


def _index_problems(index: Path) -> list[str]:
    """Shards named by a ``*.safetensors.index.json`` file that are missing from its folder."""
    try:
        weight_map: dict[str, Any] = json.loads(index.read_bytes()).get("weight_map", {})
    except (ValueError, UnicodeDecodeError, AttributeError):
        return []  # reported by _json_problem
    shards = sorted({str(shard) for shard in weight_map.values()})
    return [f"{index.name} names {shard}, which is missing" for shard in shards if not (index.parent / shard).is_file()]


def _folder_problems(folder: Path) -> list[str]:
    """Damage visible without checksums in a checkpoint folder: broken JSON, truncated safetensors.

    Parameters
    ----------
    folder : Path
        A folder written by ``save_pretrained``.

    Returns
    -------
    list of str
        One sentence per damaged file, naming it; empty when nothing is wrong.
    """
    problems: list[str] = []
    for path in sorted(folder.glob("*.json")):
        problem = _json_problem(path)
        if problem is not None:
            problems.append(problem)
        elif path.name.endswith(".safetensors.index.json"):
            single = path.with_name(path.name[: -len(".index.json")])  # loaders prefer it when present
            if not single.is_file():
                problems += _index_problems(path)
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem is not None:
            problems.append(problem)
    return problems


def _file_record(path: Path) -> dict[str, Any]:
    """What :func:`_record_problems` later compares a file with: size, mtime and sha256."""
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256(path)}


def _record_problems(folder: Path, files: dict[str, dict[str, Any]], *, full: bool) -> tuple[list[str], bool]:
    """Compare the files in ``folder`` with their records.

    Sizes are always compared; a file's sha256 only when ``full`` is set or its modification time
    differs from the recorded one (copied, touched or rewritten).

    Returns
    -------
    problems : list of str
        One sentence per file that is missing, of the wrong size or of the wrong checksum.
    rehashed : bool
        Whether a file whose modification time changed was found intact by its checksum (its
        record's time is then out of date).
    """
    problems: list[str] = []
    rehashed = False
    for name, record in sorted(files.items()):
        path = folder / name
        if not isinstance(record, dict):
            problems.append(f"the record of {name} is unreadable")
            continue
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        stat = path.stat()
        if stat.st_size != record.get("size"):
            problems.append(f"{name} is {stat.st_size} bytes, {record.get('size')} were written (truncated or changed)")
            continue
        moved = stat.st_mtime_ns != record.get("mtime_ns")
        if full or moved:
            if _sha256(path) != record.get("sha256"):
                problems.append(f"{name} does not match the sha256 recorded when it was written (corrupted)")
            elif moved:
                rehashed = True
    return problems, rehashed
