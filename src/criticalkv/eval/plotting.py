"""Headless plotting for the experiments' figures: :mod:`matplotlib.pyplot` on the ``Agg`` backend."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """:mod:`matplotlib.pyplot`, with the non-interactive ``Agg`` backend selected first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
