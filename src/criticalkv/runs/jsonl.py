"""An append-only JSON-lines file that survives interruption."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Dumps = Callable[[Mapping[str, Any]], str]


def sorted_dumps(row: Mapping[str, Any]) -> str:
    """One JSON line with sorted keys (the sweeps' ``results.jsonl``)."""
    return json.dumps(row, sort_keys=True)


def compact_dumps(row: Mapping[str, Any]) -> str:
    """One compact JSON line in insertion order (the analysis' ``results.jsonl``)."""
    return json.dumps(row, separators=(",", ":"))


class JsonLines:
    """Rows of ``path``, one JSON object per line.

    Each row is written with one ``write`` on a descriptor opened with ``O_APPEND``, and the
    file is synced after each :meth:`append`, so a row is either complete on disk or absent. A
    torn last line left by a crash is cut off the file when the log is opened or read.
    """

    def __init__(self, path: Path, dumps: Dumps = sorted_dumps) -> None:
        self.path = Path(path)
        self.dumps = dumps
        self.repair()

    def _check(self) -> None:
        if self.path.is_dir():
            raise ValueError(f"{self.path} is a folder, not a results file; move it out of the way")

    def repair(self) -> None:
        """Cut off an incomplete last line (an interrupted write)."""
        self._check()
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        logger.warning("dropping a torn last line of %s (an interrupted write)", self.path)
        with self.path.open("r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)

    def numbered_rows(self) -> list[tuple[int, dict[str, Any]]]:
        """``(line number, row)`` of every complete row, in file order; lines that are not a
        UTF-8 JSON object are skipped with a warning naming the file and line."""
        self.repair()
        if not self.path.is_file():
            return []
        rows = []
        for number, raw in enumerate(self.path.read_bytes().splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                logger.warning("skipping line %d of %s: not valid JSON", number, self.path)
                continue
            if not isinstance(row, dict):
                logger.warning(
                    "skipping line %d of %s: a JSON %s, not an object", number, self.path, type(row).__name__
                )
                continue
            rows.append((number, row))
        return rows

    def rows(self) -> list[dict[str, Any]]:
        """Every complete row, in file order (see :meth:`numbered_rows`)."""
        return [row for _, row in self.numbered_rows()]

    def append(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append ``rows``, one line (and one write) each, then sync the file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for row in rows:
                os.write(fd, (self.dumps(row) + "\n").encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
