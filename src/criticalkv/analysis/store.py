"""Resumable result files: one JSON line per (sample, method, budget), and the run's provenance."""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"
CONFIG_FILE = "config.json"

Key = tuple[int, str, str]


def row_key(row: Mapping[str, Any]) -> Key:
    """The identity of a result row: (sample index, method, budget as text)."""
    return int(row["sample"]), str(row["method"]), str(row["budget"])


class ResultsLog:
    """An append-only JSON-lines file that survives interruption.

    Each row is written with one ``write`` on a file opened with ``O_APPEND`` and synced, so a row
    is either complete on disk or absent; a torn last line left by a crash is dropped (and cut off
    the file) the next time the log is opened.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._repair()

    def _repair(self) -> None:
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        logger.warning("dropping a torn last line of %s (an interrupted write)", self.path)
        with self.path.open("r+b") as fh:
            fh.truncate(cut)

    def rows(self) -> list[dict[str, Any]]:
        """Every complete row, in file order; lines that do not parse are skipped with a warning."""
        if not self.path.is_file():
            return []
        rows = []
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("skipping line %d of %s: not valid JSON", number, self.path)
        return rows

    def done(self) -> set[Key]:
        """Keys of the rows already on disk."""
        return {row_key(row) for row in self.rows()}

    def append(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append ``rows``, one line each, and sync the file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for row in rows:
                os.write(fd, (json.dumps(row, separators=(",", ":")) + "\n").encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)


def _git_commit(start: Path) -> str | None:
    """The commit checked out in the git work tree above ``start``, read from ``.git`` (no git process)."""
    for folder in [start, *start.parents]:
        git = folder / ".git"
        if not git.is_dir():
            continue
        try:
            head = (git / "HEAD").read_text().strip()
            if not head.startswith("ref: "):
                return head
            ref = head[5:]
            if (git / ref).is_file():
                return (git / ref).read_text().strip()
            packed = git / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split(" ", 1)[0]
        except OSError:
            return None
        return None
    return None


def provenance() -> dict[str, Any]:
    """Library versions, platform and git commit, for a run's config file."""
    import torch
    import transformers

    import criticalkv

    return {
        "criticalkv": criticalkv.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(Path(criticalkv.__file__).resolve().parent),
    }


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
    path = Path(out_dir) / CONFIG_FILE
    spec = dict(spec)
    if path.is_file():
        config: dict[str, Any] = json.loads(path.read_text())
        old = config.get("spec", {})
        if old != spec:
            changed = sorted(k for k in set(old) | set(spec) if old.get(k) != spec.get(k))
            details = ", ".join(f"{k}: {old.get(k)!r} there, {spec.get(k)!r} now" for k in changed)
            raise ValueError(
                f"{out_dir} holds results measured with other settings ({details}); pass a new --out "
                "folder, or the same settings to resume"
            )
    else:
        config = {"spec": spec, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "commands": []}
    config["provenance"] = provenance()
    if command:
        config["commands"] = [*config.get("commands", []), command]
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(staging, path)
    return config


def read_run_config(out_dir: Path) -> dict[str, Any]:
    """``out_dir/config.json`` (an empty dict if there is none)."""
    path = Path(out_dir) / CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def round_floats(values: Sequence[Any], digits: int = 6) -> list[Any]:
    """Nested lists of floats rounded to ``digits`` significant digits (for compact JSON lines)."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.append(round_floats(v, digits))
        else:
            out.append(float(f"{float(v):.{digits}g}"))
    return out
