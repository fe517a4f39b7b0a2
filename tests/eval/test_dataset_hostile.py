"""Hostile dataset files (issue 41): a UTF-8 byte-order mark, a line too long to hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from criticalkv.eval.tasks import dataset
from criticalkv.eval.tasks.dataset import line_hash, load_dataset_file, unusable_lines

ROW = {"context": "The grass is green. The code is 7.", "question": "Code?", "answers": ["7"]}


def test_a_byte_order_mark_does_not_cost_the_first_line(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(ROW) + "\r\n" + json.dumps(ROW) + "\n").encode("utf-8"))
    samples = load_dataset_file(path)
    assert [s.index for s in samples] == [1, 2] and unusable_lines(path) == []
    assert samples[0].meta["sha256"] == line_hash(ROW)  # the same content, the same hash


def test_a_line_over_the_stated_size_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataset, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "context": "x" * 5000}) + "\n")
    with pytest.raises(ValueError, match=r"line 2 of dataset file .* is over 1,000 bytes"):
        load_dataset_file(path)
    path.write_text(json.dumps({**ROW, "context": "x" * 900}) + "\n")  # within the limit: read
    assert len(load_dataset_file(path)) == 1


def test_a_file_that_is_not_utf8_is_still_one_sentence(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes((json.dumps(ROW) + "\n").encode() + b'{"context": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        load_dataset_file(path)
