"""A reference answer that is empty or only whitespace matches every prediction (issue 30, case 5:
``"answers": [" "]`` scored every prediction 1.0 with exit 0, and ``[""]`` stopped the sweep with
an internal message naming no line). Such a dataset line is now skipped with a warning naming
it, and the metrics refuse a blank answer instead of scoring 1.0."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from criticalkv.eval.tasks import char_credit, load_dataset_file, string_match_all, string_match_part


@pytest.mark.parametrize("metric", [string_match_part, string_match_all])
@pytest.mark.parametrize("answers", [[" "], [""], ["42", "\t"]])
def test_the_metrics_refuse_a_blank_answer(metric, answers: list[str]) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="empty or only whitespace"):
        metric("any prediction at all", answers)


def test_partial_credit_gives_a_blank_answer_none() -> None:
    assert char_credit("any prediction", [" "]) == 0.0


def test_a_dataset_line_with_a_blank_answer_is_skipped_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "d.jsonl"
    lines = [
        {"context": "The code is 42.", "question": "Code?", "answers": ["42"]},
        {"context": "The code is 17.", "question": "Code?", "answers": [" "]},
        {"context": "The code is 99.", "question": "Code?", "answers": ""},
        {"context": "The code is 5.", "question": "Code?", "answers": ["5"]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="criticalkv.eval.tasks.dataset"):
        samples = load_dataset_file(path)
    assert [s.index for s in samples] == [1, 4]
    assert f"{path}:2: an answer is empty or only whitespace" in caplog.text
    assert f"{path}:3: an answer is empty or only whitespace" in caplog.text
