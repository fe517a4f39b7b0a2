"""An append-only JSON-lines file that survives interruption."""

from __future__ import annotations

import errno
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


class ResultsWriteError(ValueError):
    """A row could not be written (a full or read-only disk, no permission): every complete row
    before it is kept, no partial line is left, and the same command resumes from them."""


class JsonLines:
    """Rows of ``path``, one JSON object per line.

    Each row is written whole (a short write is continued, a failed one cut back off the file) on a
    descriptor opened with ``O_APPEND``, and the file is synced after each :meth:`append`, so a row
    is either complete on disk or absent. Readers never modify the file (another process may be
    appending to it): an incomplete last line is ignored when read, and cut off by the next
    :meth:`append`, which the one writer (holding the folder's writer lock) makes.
    """

    def __init__(self, path: Path, dumps: Dumps = sorted_dumps) -> None:
        self.path = Path(path)
        self.dumps = dumps
        self._check()

    def _check(self) -> None:
        if self.path.is_dir():
            raise ValueError(f"{self.path} is a folder, not a results file; move it out of the way")

    def repair(self) -> None:
        """Cut off an incomplete last line (an interrupted write). Only the writer calls this."""
        self._check()
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        logger.warning("dropping a torn last line of %s (an interrupted write)", self.path)
        with self.path.open("r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)

    def append(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append ``rows``, one line each, then sync the file.

        Raises
        ------
        ResultsWriteError
            A row could not be written whole (``ENOSPC``, ``EROFS``, ``EACCES``, ...): the rows
            before it are on disk, the partial one is cut off, and the message says so.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.repair()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for row in rows:
                self._write_line(fd, (self.dumps(row) + "\n").encode("utf-8"))
            try:
                os.fsync(fd)
            except OSError as error:
                raise self._failure(error) from error
        finally:
            os.close(fd)

    def _write_line(self, fd: int, data: bytes) -> None:
        """Write ``data`` whole, continuing short writes; on failure cut the partial line off."""
        start = os.fstat(fd).st_size
        done = 0
        try:
            while done < len(data):
                written = os.write(fd, data[done:])
                if written <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += written
        except OSError as error:
            try:
                os.ftruncate(fd, start)
            except OSError:
                logger.warning("could not cut the partial line off %s; the next run drops it", self.path)
            raise self._failure(error) from error

    def _failure(self, error: OSError) -> ResultsWriteError:
        why = error.strerror or str(error)
        code = errno.errorcode.get(error.errno or 0, "")
        return ResultsWriteError(
            f"could not write to {self.path}: {why}{f' ({code})' if code else ''}; every complete line before "
            "is kept and no partial line is left: free space (or fix the permissions) and run the same command "
            "again to resume"
        )

    def numbered_rows(self) -> list[tuple[int, dict[str, Any]]]:
        """``(line number, row)`` of every complete row, in file order; lines that are not a
        UTF-8 JSON object are skipped with a warning naming the file and line. An incomplete last
        line (being written, or torn by an interruption) is ignored; the file is not changed."""
        self._check()
        if not self.path.is_file():
            return []
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
        rows = []
        for number, raw in enumerate(data.splitlines(), start=1):
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
