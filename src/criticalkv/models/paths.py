"""Where CriticalKV keeps downloaded and converted files."""

from __future__ import annotations

import os
from pathlib import Path

_DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """The folder where CriticalKV keeps downloaded and converted files.

    Returns
    -------
    Path
        ``$CRITICALKV_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/criticalkv`` if
        ``XDG_CACHE_HOME`` is set to an absolute path, else ``~/.cache/criticalkv``. The folder
        is not created.
    """
    explicit = os.environ.get("CRITICALKV_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
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
