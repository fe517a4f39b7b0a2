"""Writing a safetensors file atomically: a temporary file in the same folder, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_atomically(tensors: dict[str, torch.Tensor], target: Path, metadata: dict[str, str]) -> None:
    """Write ``tensors`` with ``metadata`` to ``target``: a reader sees the old file or the whole new one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata=metadata)
        with open(temporary, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform that cannot open folders (Windows): the rename is durable enough
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
