"""Where a result came from: library versions, platform and the git commit of the code."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any


def git_commit() -> str | None:
    """The commit checked out where this package lives (``None`` outside a git work tree)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def versions() -> dict[str, str]:
    """Versions of criticalkv, torch and transformers."""
    import torch
    import transformers

    import criticalkv

    return {"criticalkv": criticalkv.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def provenance() -> dict[str, Any]:
    """:func:`versions` with the Python version, the platform and the git commit."""
    return {
        **versions(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
    }
