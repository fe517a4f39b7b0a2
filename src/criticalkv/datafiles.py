"""Cached reads of the data files shipped in ``criticalkv/data`` (word lists, haystacks, tables).

Read through :mod:`importlib.resources`, so they load from an installed wheel as from a checkout.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def read_text(path: str) -> str:
    """The text of ``criticalkv/data/{path}`` (``path`` is ``/``-separated, e.g. ``"words/nouns.txt"``)."""
    return resources.files("criticalkv").joinpath("data", *path.split("/")).read_text(encoding="utf-8")


@cache
def read_lines(path: str) -> tuple[str, ...]:
    """The lines of a data file, without their line endings (one entry per line)."""
    return tuple(read_text(path).splitlines())


def read_json(path: str) -> Any:
    """A data file parsed as JSON (a fresh object on every call, so callers may keep or change it)."""
    return json.loads(read_text(path))


def word_list(name: str) -> list[str]:
    """The word list ``data/words/{name}.txt``, one word per line, in file order."""
    return list(read_lines(f"words/{name}.txt"))
