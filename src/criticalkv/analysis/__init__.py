"""Perturbation analysis (CriticalKV, Feng et al. 2025, arXiv 2502.03805): per-head output
perturbation ``||o - o_hat||_1``, its bound ``theta``, and the final hidden-state drift.

* :mod:`~criticalkv.analysis.output_perturbation` -- attention weights, head outputs ``A V W_O^h`` and
  the perturbation of each keep mask, vectorised over heads and masks.
* :mod:`~criticalkv.analysis.bound` -- the kept mass ``sigma`` and the bound ``theta``.
* :mod:`~criticalkv.analysis.drift` -- final-layer hidden-state drift (L1, cosine).
* :mod:`~criticalkv.analysis.query_recording` -- recording the decode queries of a forward pass.
* :mod:`~criticalkv.analysis.configs`, :mod:`~criticalkv.analysis.run_spec`,
  :mod:`~criticalkv.analysis.measure`, :mod:`~criticalkv.analysis.experiment` -- the experiment
  (``criticalkv perturbation``): what is compared, what a folder measures, one sample, the run.
* :mod:`~criticalkv.analysis.results_log`, :mod:`~criticalkv.analysis.aggregate`,
  :mod:`~criticalkv.analysis.experiment_report`, :mod:`~criticalkv.analysis.plots` -- resumable results,
  aggregation over samples, ``heads.csv`` / ``summary.md`` and the figures.
"""

from criticalkv.analysis.bound import Bound, kept_mass, perturbation_bound
from criticalkv.analysis.drift import HiddenDrift, hidden_state_drift
from criticalkv.analysis.experiment import RunSpec, comparison_configs, measure_sample, run_perturbation
from criticalkv.analysis.experiment_report import write_report
from criticalkv.analysis.output_perturbation import (
    LayerPerturbation,
    attention_weights,
    head_outputs,
    output_perturbation,
)
from criticalkv.analysis.query_recording import recording_queries

__all__ = [
    "Bound",
    "HiddenDrift",
    "LayerPerturbation",
    "RunSpec",
    "attention_weights",
    "comparison_configs",
    "head_outputs",
    "hidden_state_drift",
    "kept_mass",
    "measure_sample",
    "output_perturbation",
    "perturbation_bound",
    "recording_queries",
    "run_perturbation",
    "write_report",
]
