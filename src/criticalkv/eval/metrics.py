"""Task metrics (RULER's string matching) and partial credit."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """Share of the answers found in the prediction, case-insensitive (RULER)."""
    if not answers:
        raise ValueError("no reference answers")
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """1 if any answer occurs in the prediction, case-insensitive (RULER's QA metric)."""
    if not answers:
        raise ValueError("no reference answers")
    pred = prediction.lower()
    return float(any(a.lower() in pred for a in answers))


def char_credit(prediction: str, answers: Sequence[str]) -> float:
    """Partial credit: for each answer, the longest share of its characters (digits of a needle,
    say) reproduced in order as a contiguous run; averaged over answers."""
    if not answers:
        raise ValueError("no reference answers")
    pred = prediction.lower()
    total = 0.0
    for answer in answers:
        a = answer.lower()
        best = 0
        for start in range(len(a)):
            for end in range(len(a), start + best, -1):
                if a[start:end] in pred:
                    best = end - start
                    break
        total += best / max(len(a), 1)
    return total / len(answers)


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def get_metric(name: str) -> Callable[[str, Sequence[str]], float]:
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; choose from: {', '.join(METRICS)}")
    return METRICS[name]
