"""LongBench (Bai et al. 2023, arXiv 2308.14508) for the sweep runner: datasets, prompts,
truncation, metrics and LongBench-E's length buckets.

``criticalkv eval --benchmark longbench --tasks ... --data-dir DIR`` runs it; see docs/evaluation.md.
"""

from criticalkv.eval.longbench.buckets import BUCKETS, bucket_of
from criticalkv.eval.longbench.loader import LongBenchUnavailable, Record, load_records, parse_row
from criticalkv.eval.longbench.samples import iter_samples, make_sample
from criticalkv.eval.longbench.scoring import SCORERS, bind, score
from criticalkv.eval.longbench.tasks import DATASETS, E_DATASETS, EN_DATASETS, ZH_DATASETS, resolve_tasks

__all__ = [
    "BUCKETS",
    "DATASETS",
    "EN_DATASETS",
    "E_DATASETS",
    "SCORERS",
    "ZH_DATASETS",
    "LongBenchUnavailable",
    "Record",
    "bind",
    "bucket_of",
    "iter_samples",
    "load_records",
    "make_sample",
    "parse_row",
    "resolve_tasks",
    "score",
]
