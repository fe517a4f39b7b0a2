"""LongBench-E's length buckets (``eval.py``'s ``scorer_e``)."""

from __future__ import annotations

#: bucket labels, shortest first
BUCKETS: tuple[str, ...] = ("0-4k", "4-8k", "8k+")


def bucket_of(length: int) -> str:
    """The bucket of a sample by its ``length`` field (words for English and code, characters
    for Chinese; not tokens): below 4000, below 8000, or more."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"
