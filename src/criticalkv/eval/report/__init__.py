"""What a finished run says: the sweep's report (:func:`build_report`: ``summary.csv``, the tables
and figures), its bootstrap intervals, and the comparison of lm-eval runs.

Code outside ``eval/`` imports these names from here, not from the modules inside.
"""

from __future__ import annotations

from criticalkv.eval.report.bootstrap import (
    INTERVAL_COLUMNS,
    LEVEL,
    MIN_PAIRED_SAMPLES,
    RESAMPLES,
    SEED,
    by_config,
    cell_intervals,
    describe_difference,
    distinguishable,
    paired_difference,
    paired_differences,
    stratified_interval,
)
from criticalkv.eval.report.figures import budget_figure, chosen_budget, tasks_figure
from criticalkv.eval.report.lmeval_runs import find_runs, format_lmeval_report, is_lmeval_folder
from criticalkv.eval.report.summary import AVERAGE, base_of, loss_reductions, summary_rows
from criticalkv.eval.report.sweep import FIELDS, build_report, format_tables, plot, plot_title, summarise

__all__ = [
    "AVERAGE",
    "FIELDS",
    "INTERVAL_COLUMNS",
    "LEVEL",
    "MIN_PAIRED_SAMPLES",
    "RESAMPLES",
    "SEED",
    "base_of",
    "budget_figure",
    "build_report",
    "by_config",
    "cell_intervals",
    "chosen_budget",
    "describe_difference",
    "distinguishable",
    "find_runs",
    "format_lmeval_report",
    "format_tables",
    "is_lmeval_folder",
    "loss_reductions",
    "paired_difference",
    "paired_differences",
    "plot",
    "plot_title",
    "stratified_interval",
    "summarise",
    "summary_rows",
    "tasks_figure",
]
