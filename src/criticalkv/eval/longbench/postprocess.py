"""Prediction post-processing before scoring (LongBench's ``eval.py``)."""

from __future__ import annotations


def first_line(prediction: str) -> str:
    """The first line after leading newlines: LongBench scores ``trec``, ``triviaqa``, ``samsum``
    and ``lsht`` (few-shot prompts the model tends to continue) on ``pred.lstrip('\\n').split('\\n')[0]``."""
    return prediction.lstrip("\n").split("\n")[0]
