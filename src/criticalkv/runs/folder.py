"""A results folder's config file: the run identity, checked on resume, and a growing history."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FolderLayout:
    """How one kind of results folder keeps its config file.

    Attributes
    ----------
    config_file : its name (``run.json``, ``config.json``).
    identity_key : the entry holding the identity: what must match to resume into the folder.
    history_key : the entry listing one item per run.
    exact : ``True``: the identities must be equal; ``False``: only the keys of the new identity
        are compared (a folder written before a key existed resumes).
    mismatch : the error message on a mismatch, with ``{out}`` and ``{diff}`` fields.
    separator : between the ``"key: a there, b now"`` parts of ``{diff}``.
    trailing_newline : end the file with a newline.
    optional : keys written only when set (absent means unset); with ``exact=False`` they are
        compared in both directions, so a folder made with one never resumes without it.
    results_file : the folder's results (``results.jsonl``): while it holds no complete line, a
        folder of another identity is not refused but taken over (a run stopped before its first
        result, or refused after writing its config, leaves nothing to protect).
    """

    config_file: str
    identity_key: str
    history_key: str
    exact: bool
    mismatch: str
    separator: str = "; "
    trailing_newline: bool = False
    optional: tuple[str, ...] = ()
    results_file: str | None = None


def holds_results(out_dir: Path, layout: FolderLayout) -> bool:
    """Whether the folder's results file holds a complete line (without one: always, to be safe)."""
    if layout.results_file is None:
        return True
    path = out_dir / layout.results_file
    if not path.is_file():
        return False
    data = path.read_bytes()
    return any(line.strip() for line in data[: data.rfind(b"\n") + 1].splitlines())


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (an empty dict if there is none).

    Raises
    ------
    ValueError
        If ``path`` is a folder, or holds something other than a JSON object.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a file; move it out of the way")
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is damaged ({error}); restore it, or move the folder aside and start anew") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} holds a JSON {type(data).__name__}, not an object; restore it or move the folder aside"
        )
    return data


def write_json(path: Path, data: Mapping[str, Any], trailing_newline: bool = False) -> None:
    """Write ``data`` (indented) through a temporary file, so a reader never sees half of it."""
    text = json.dumps(data, indent=2) + ("\n" if trailing_newline else "")
    write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def write_atomically(path: Path, write: Callable[[Path], object]) -> Path:
    """``write(temporary)`` then rename it to ``path``, so ``path`` is whole or as it was: a full or
    read-only disk leaves no empty or partial file (the temporary is removed), and the ``OSError``
    names ``path`` (the command line says it in one sentence). The temporary keeps ``path``'s
    suffix (matplotlib picks the format from it)."""
    path = Path(path)
    temporary = path.with_name(f".{path.stem}.partial{path.suffix}")
    try:
        write(temporary)
        os.replace(temporary, path)
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from error
    finally:
        temporary.unlink(missing_ok=True)
    return path


def write_text_atomically(path: Path, text: str) -> Path:
    """:func:`write_atomically` of UTF-8 ``text``."""
    return write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def identity_diff(layout: FolderLayout, before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``"key: a there, b now"`` for each key whose value differs (see :attr:`FolderLayout.exact`)."""
    if layout.exact:
        keys = sorted(set(before) | set(now))
    else:
        keys = [*now, *(k for k in layout.optional if k in before and k not in now)]
    return [f"{k}: {before.get(k)!r} there, {now.get(k)!r} now" for k in keys if before.get(k) != now.get(k)]


def open_folder(
    out_dir: Path,
    layout: FolderLayout,
    identity: Mapping[str, Any],
    entry: Any | None = None,
    *,
    new: Callable[[], dict[str, Any]] = dict,
    update: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Create ``out_dir``'s config file, or check that the one there has the same identity.

    ``entry`` (if any) is appended to the history; ``new()`` gives the extra entries of a new
    file, ``update`` those rewritten on every run. Returns what was written.

    Raises
    ------
    ValueError
        If the folder holds results of another identity (:attr:`FolderLayout.mismatch`).
    """
    out_dir = Path(out_dir)
    path = out_dir / layout.config_file
    config = read_json(path)
    if path.is_file():
        diff = identity_diff(layout, config.get(layout.identity_key, {}), identity)
        if diff and holds_results(out_dir, layout):
            raise ValueError(layout.mismatch.format(out=out_dir, diff=layout.separator.join(diff)))
        if diff:
            logger.warning("%s holds no results yet: its configuration is replaced (%s)", out_dir, "; ".join(diff))
        config[layout.identity_key] = dict(identity)
    else:
        config = {layout.identity_key: dict(identity), **new(), layout.history_key: []}
    if entry is not None:
        config[layout.history_key] = [*config.get(layout.history_key, []), entry]
    config.update(update or {})
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(path, config, layout.trailing_newline)
    return config
