"""One evaluation sample, the unit every benchmark produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """A (context, question) pair with its gold answers.

    ``context`` is what question-agnostic mode compresses; ``question`` follows it;
    ``answer_prefix`` is placed at the start of the model's turn (RULER's answer prefixes).
    """

    task: str
    index: int
    context: str
    question: str
    answers: list[str]
    metric: str
    max_new_tokens: int
    answer_prefix: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
