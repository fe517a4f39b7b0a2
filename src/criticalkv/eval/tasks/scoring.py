"""Task metrics (RULER's string matching, LongBench's metrics) and partial credit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from difflib import SequenceMatcher
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from criticalkv.eval.sample import Sample


def check_answers(answers: Sequence[str]) -> None:
    """A ``ValueError`` unless there are answers and none is empty or whitespace only (such an
    answer is found in every prediction: it would score every method 1.0)."""
    if not answers:
        raise ValueError("no reference answers")
    if any(not a.strip() for a in answers):
        raise ValueError(
            f"a reference answer is empty or only whitespace ({list(answers)!r}): it matches every prediction"
        )


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """Share of the answers found in the prediction, case-insensitive (RULER)."""
    check_answers(answers)
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """1 if any answer occurs in the prediction, case-insensitive (RULER's QA metric)."""
    check_answers(answers)
    pred = prediction.lower()
    return float(any(a.lower() in pred for a in answers))


def char_credit(prediction: str, answers: Sequence[str]) -> float:
    """Partial credit: for each answer, the longest share of its characters (digits of a needle,
    say) reproduced in order as a contiguous run; averaged over answers (a blank answer: no credit)."""
    if not answers:
        raise ValueError("no reference answers")
    pred = prediction.lower()
    total = 0.0
    for answer in answers:
        a = answer.lower()
        if not a.strip():
            continue  # whitespace is found in any prediction: no credit for it
        # the longest common substring; difflib finds it in ~O(len * matches), not O(len^2) searches
        best = SequenceMatcher(None, a, pred, autojunk=False).find_longest_match(0, len(a), 0, len(pred)).size
        total += best / max(len(a), 1)
    return total / len(answers)


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def get_metric(name: str) -> Callable[[str, Sequence[str]], float]:
    """A metric that needs only ``(prediction, answers)``; see :func:`bind_metric` for the rest."""
    if name not in METRICS:
        from criticalkv.eval.longbench.scoring import SCORERS

        hint = " (a LongBench metric: score it with bind_metric(sample))" if name in SCORERS else ""
        raise ValueError(f"unknown metric {name!r}{hint}; choose from: {', '.join(METRICS)}")
    return METRICS[name]


def bind_metric(sample: Sample) -> Callable[[str, Sequence[str]], float]:
    """The ``(prediction, answers) -> score`` function of ``sample``: a plain metric by name, or
    a LongBench metric bound to what it needs from the sample (``all_classes`` for
    classification, the first-line post-processing of the few-shot datasets)."""
    from criticalkv.eval.longbench.scoring import SCORERS, bind

    if sample.metric in SCORERS:
        return bind(sample)
    return get_metric(sample.metric)
