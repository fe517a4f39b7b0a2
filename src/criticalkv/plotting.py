"""Headless plotting for the experiments' figures: :mod:`matplotlib.pyplot` on the ``Agg`` backend.

matplotlib is the optional ``[plots]`` extra: nothing imports it before a figure is drawn, and a
figure asked for without it is :class:`MissingMatplotlib`, a sentence with the install command.
"""

from __future__ import annotations

from typing import Any

#: how to install what the figures need
INSTALL_HINT = "pip install -e '.[plots]' (in a clone; or: pip install 'matplotlib>=3.7')"

_SPARE = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354"]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*"]
_LINES = ["-", "--", "-.", ":"]


def _index(method: str) -> int:
    """A stable index for ``method`` (its place among the registered methods, else a sum of its characters)."""
    from criticalkv.methods import available_methods

    names = available_methods()
    return names.index(method) if method in names else len(names) + sum(map(ord, method))


def method_style(method: str) -> dict[str, Any]:
    """``color``, ``marker``, ``linestyle``, ``markersize`` and ``markerfacecolor`` (hollow) of
    ``method`` in every figure: the same colour everywhere, and markers, sizes and line styles that
    differ between methods so that coinciding lines stay visible (a method name with options or a
    suffix, ``snapkv+q4``, takes its base's colour). A method's colour is given where it is
    registered (:func:`criticalkv.methods.register`); one registered without gets a spare colour."""
    from criticalkv.methods import method_colour

    base = method.split(":")[0].split("+")[0]
    i = _index(base)
    colour = method_colour(base) or _SPARE[i % len(_SPARE)]
    return {
        "color": colour,
        "marker": _MARKERS[i % len(_MARKERS)],
        "linestyle": _LINES[i % len(_LINES)],
        "markersize": 11 - 1.5 * (i % 5),  # hollow markers of different sizes nest where points coincide
        "markerfacecolor": "none",
    }


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


#: the widest a figure title runs before it wraps (characters at the figures' title sizes)
TITLE_WIDTH = 90


def wrapped(title: str, width: int = TITLE_WIDTH) -> str:
    """``title`` broken into lines of at most ``width`` characters, so no figure cuts it off."""
    import textwrap

    return "\n".join(textwrap.wrap(title, width)) if title else title


def dodged(position: float, index: int, count: int, spread: float = 0.5) -> float:
    """``position`` moved sideways for the ``index``-th of ``count`` series sharing it: the series of
    one x position sit side by side across ``spread`` (in x units) instead of on top of each other."""
    if count <= 1:
        return position
    return position + spread * (index / (count - 1) - 0.5)


def category_axis(ax: Any, values: list[float], label: str) -> dict[float, int]:
    """An x axis with one evenly spaced tick per value (labelled as the value, ``g`` format): one budget
    gives one tick, not a run of decimals; returns each value's x position."""
    positions = {value: i for i, value in enumerate(values)}
    ax.set_xticks(range(len(values)), [f"{v:g}" for v in values])
    ax.set_xlim(-0.6, len(values) - 0.4)
    ax.set_xlabel(label)
    return positions


def legend_outside(ax: Any, **options: Any) -> Any:
    """The axes' legend to the right of its plot area, where it covers no data."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **{"fontsize": 7, **options})
