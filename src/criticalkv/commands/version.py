"""The installed library's version, as ``criticalkv --version`` prints it."""

from __future__ import annotations

from importlib import metadata


def library_version() -> str:
    """The installed distribution's version (the package's own when it is not installed)."""
    try:
        return metadata.version("criticalkv")
    except metadata.PackageNotFoundError:
        from criticalkv import __version__

        return __version__
