"""One evaluation sample, the unit every benchmark produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """A (context, question) pair with its gold answers.

    ``context`` is what question-agnostic mode compresses; ``question`` follows it;
    ``answer_prefix`` is placed at the start of the model's turn (RULER's answer prefixes).

    ``verbatim``: ``context + question`` is the exact prompt text (LongBench's templates), so no
    separator or ``"Answer:"`` is added between or after them. ``chat=False``: never wrap this
    sample in the chat template (LongBench's few-shot and code datasets). ``gold``: the text
    teacher-forced for the fidelity metrics (default: the answers joined by ", ").
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
    verbatim: bool = False
    chat: bool = True
    gold: str | None = None


def encode_sample(tokenizer: Any, sample: Sample, chat: bool = True) -> tuple[list[int], list[int]]:
    """Token ids of a sample's context part and question part; ``chat`` is the sweep's setting."""
    from criticalkv.prompts import encode_pair

    return encode_pair(
        tokenizer,
        sample.context,
        sample.question,
        chat and sample.chat,
        sample.answer_prefix,
        verbatim=sample.verbatim,
    )
