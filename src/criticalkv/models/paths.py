"""Where CriticalKV keeps downloaded and converted files."""

from __future__ import annotations

import os
from pathlib import Path

_DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelCacheError(RuntimeError, ValueError):
    """The model cache cannot serve the default model (a file where its folder should be, a full,
    read-only or damaged cache, a fetch that failed offline); the message says what to do. A
    ``ValueError`` too, so the command line prints it as one error (exit 2), not a traceback."""


def cache_dir() -> Path:
    """The folder where CriticalKV keeps downloaded and converted files.

    Returns
    -------
    Path
        ``$CRITICALKV_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/criticalkv`` if
        ``XDG_CACHE_HOME`` is set to an absolute path, else ``~/.cache/criticalkv``. The folder
        is not created.

    Raises
    ------
    ModelCacheError
        ``$CRITICALKV_CACHE_DIR`` names a file.
    """
    explicit = os.environ.get("CRITICALKV_CACHE_DIR")
    if explicit:
        folder = Path(explicit).expanduser()
        if folder.exists() and not folder.is_dir():
            raise ModelCacheError(
                f"CRITICALKV_CACHE_DIR={explicit} is a file, not a folder: point it at a folder (it is created "
                "if missing), or unset it for ~/.cache/criticalkv"
            )
        return folder
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "criticalkv"
    return Path.home() / ".cache" / "criticalkv"


def default_model_dir() -> Path:
    """The folder holding the default model once converted to a safetensors checkpoint.

    Returns
    -------
    Path
        ``cache_dir() / "models" / "SmolLM2-135M-Instruct"``. It exists only after the first
        ``load_model("default")``.
    """
    return cache_dir() / "models" / _DEFAULT_MODEL_NAME
