"""The perturbation experiment's results folder (a :mod:`criticalkv.runs` folder): one JSON line
per (sample, method, budget) in ``results.jsonl`` and the run's spec and provenance in ``config.json``."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from criticalkv.runs import FolderLayout, JsonLines, open_folder, provenance, read_json
from criticalkv.runs.jsonl import compact_dumps

RESULTS_FILE = "results.jsonl"
CONFIG_FILE = "config.json"

LAYOUT = FolderLayout(
    config_file=CONFIG_FILE,
    identity_key="spec",
    history_key="commands",
    exact=True,
    mismatch="{out} holds results measured with other settings ({diff}); pass a new --out folder, "
    "or the same settings to resume",
    separator=", ",
    trailing_newline=True,
    results_file="results.jsonl",
)

Key = tuple[int, str, str]


def row_key(row: Mapping[str, Any]) -> Key:
    """The identity of a result row: (sample index, method, budget as text)."""
    return int(row["sample"]), str(row["method"]), str(row["budget"])


class ResultsLog(JsonLines):
    """The experiment's append-only ``results.jsonl`` (compact lines), keyed by :func:`row_key`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, compact_dumps)

    def done(self) -> set[Key]:
        """Keys of the rows already on disk."""
        return {row_key(row) for row in self.rows()}


def check_run_config(out_dir: Path, spec: Mapping[str, Any], command: str | None = None) -> dict[str, Any]:
    """Create or check ``out_dir/config.json``: rows of one folder must share ``spec``.

    A new folder records ``spec``, the provenance and ``command``; an existing one must hold the
    same ``spec`` (a run may add samples, methods or budgets, but not change what a row means),
    and ``command`` is added to its history.

    Raises
    ------
    ValueError
        If the folder holds results measured with a different ``spec``.
    """
    return open_folder(
        out_dir,
        LAYOUT,
        dict(spec),
        command or None,
        new=lambda: {"created": time.strftime("%Y-%m-%dT%H:%M:%S")},
        update={"provenance": provenance()},
    )


def read_run_config(out_dir: Path) -> dict[str, Any]:
    """``out_dir/config.json`` (an empty dict if there is none)."""
    return read_json(Path(out_dir) / CONFIG_FILE)


def round_floats(values: Sequence[Any], digits: int = 6) -> list[Any]:
    """Nested lists of floats rounded to ``digits`` significant digits (for compact JSON lines)."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.append(round_floats(v, digits))
        else:
            out.append(float(f"{float(v):.{digits}g}"))
    return out
