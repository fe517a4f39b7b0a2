"""Headless plotting for the experiments' figures: :mod:`matplotlib.pyplot` on the ``Agg`` backend.

matplotlib is the optional ``[plots]`` extra: nothing imports it before a figure is drawn, and a
figure asked for without it is :class:`MissingMatplotlib`, a sentence with the install command.
"""

from __future__ import annotations

from typing import Any

#: how to install what the figures need
INSTALL_HINT = "pip install 'criticalkv[plots]'"


class MissingMatplotlib(ImportError, ValueError):
    """matplotlib is not installed; raised with the command that installs it (the CLI prints it)."""


def pyplot() -> Any:
    """:mod:`matplotlib.pyplot`, with the non-interactive ``Agg`` backend selected first.

    Raises
    ------
    MissingMatplotlib
        If matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError as error:
        raise MissingMatplotlib(f"the plots need matplotlib, which is not installed: {INSTALL_HINT}") from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require_matplotlib() -> None:
    """Raise :class:`MissingMatplotlib` now: a command that will plot checks before its long run."""
    pyplot()
