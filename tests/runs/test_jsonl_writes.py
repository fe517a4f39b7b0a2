"""results.jsonl writes that cannot lose data, and reads that never change the file (issue 30,
cases 1 and 2). Before: ``append`` ignored the count ``os.write`` returned, so a short write on a
filling disk left a torn line that the next start dropped silently, and every reader "repaired"
(truncated) the file it read, cutting complete lines a concurrent writer had just appended."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
from pathlib import Path

import pytest

from criticalkv.runs import JsonLines, ResultsWriteError


def _rows(n: int, start: int = 0) -> list[dict[str, int]]:
    return [{"i": i, "pad": i * 7} for i in range(start, start + n)]


def test_a_short_write_is_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = JsonLines(tmp_path / "r.jsonl")
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, data[: max(1, len(data) // 3)]))  # a third at a time
    log.append(_rows(3))
    assert log.rows() == _rows(3)


def test_a_full_disk_mid_line_leaves_no_partial_line_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "r.jsonl"
    log = JsonLines(path)
    log.append(_rows(3))
    real, calls = os.write, []

    def filling(fd: int, data: bytes) -> int:
        calls.append(1)
        if len(calls) == 2:
            return real(fd, data[:5])  # the disk fills part-way through the second row
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", filling)
    with pytest.raises(ResultsWriteError, match=r"No space left on device \(ENOSPC\); every complete line"):
        log.append(_rows(3, start=3))
    monkeypatch.setattr(os, "write", real)
    assert path.read_bytes().endswith(b"\n")  # nothing torn for a later start to drop
    assert log.rows() == _rows(4)  # the three before and the one written whole
    log.append(_rows(2, start=4))  # space freed: the same command resumes
    assert log.rows() == _rows(6)


def test_a_read_only_file_is_a_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = JsonLines(tmp_path / "r.jsonl")

    def refused(fd: int, data: bytes) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "write", refused)
    with pytest.raises(ResultsWriteError, match=r"Read-only file system \(EROFS\).*run the same command again"):
        log.append(_rows(1))


def test_reading_a_torn_tail_ignores_it_and_leaves_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n" + '{"b": ')
    before = path.read_bytes()
    assert JsonLines(path).rows() == [{"a": 1}]
    assert path.read_bytes() == before  # a reader never truncates: a writer may be mid-line
    JsonLines(path).append([{"c": 3}])  # the writer cuts the torn tail before writing
    assert JsonLines(path).rows() == [{"a": 1}, {"c": 3}]


def _write_many(path: str, count: int) -> None:
    log = JsonLines(Path(path))
    for i in range(count):
        log.append([{"i": i, "text": "x" * (20_000 + i % 97)}])  # lines over several pages: reads see them half-done


def test_a_reader_beside_a_writer_loses_nothing(tmp_path: Path) -> None:
    """A writer process appends 400 long lines while this process reads the file over and over."""
    path = tmp_path / "r.jsonl"
    writer = multiprocessing.get_context("spawn").Process(target=_write_many, args=(str(path), 400))
    writer.start()
    seen = 0
    while writer.is_alive():
        rows = JsonLines(path).rows()
        assert [r["i"] for r in rows] == list(range(len(rows)))  # a prefix, in order: nothing cut
        seen = max(seen, len(rows))
    writer.join()
    assert writer.exitcode == 0
    assert [r["i"] for r in JsonLines(path).rows()] == list(range(400))
    assert seen > 0
