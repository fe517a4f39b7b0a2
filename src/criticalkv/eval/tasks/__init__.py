"""The samples a sweep scores and how: RULER's generated tasks (``make_sample``, ``TASK_NAMES``),
the needle of the demo and the analyses, your own JSONL files, and the answer metrics.

LongBench's datasets are their own room (:mod:`criticalkv.eval.longbench`); what a sweep runs by
name is :mod:`criticalkv.eval.benchmarks`. Code outside ``eval/`` imports these names from here.
"""

from __future__ import annotations

from criticalkv.eval.tasks.dataset import describe_usage, first_per_task, load_dataset_file, unusable_lines
from criticalkv.eval.tasks.needle import digit_credit, exact_match, make_needle_sample
from criticalkv.eval.tasks.qa_data import qa_documents
from criticalkv.eval.tasks.ruler import NOISE, TASK_NAMES, essay_sentences, essay_words, make_sample
from criticalkv.eval.tasks.scoring import (
    METRICS,
    bind_metric,
    char_credit,
    get_metric,
    string_match_all,
    string_match_part,
)
from criticalkv.eval.tasks.words import ADJECTIVES, NOUNS, distinct_keys

__all__ = [
    "ADJECTIVES",
    "METRICS",
    "NOISE",
    "NOUNS",
    "TASK_NAMES",
    "bind_metric",
    "char_credit",
    "describe_usage",
    "digit_credit",
    "distinct_keys",
    "essay_sentences",
    "essay_words",
    "exact_match",
    "first_per_task",
    "get_metric",
    "load_dataset_file",
    "make_needle_sample",
    "make_sample",
    "qa_documents",
    "string_match_all",
    "string_match_part",
    "unusable_lines",
]
