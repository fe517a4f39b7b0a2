"""The sweep behind ``criticalkv eval``: what it runs (:class:`SweepConfig`), the local runner
(:func:`run_sweep`), the evaluator both runners share and the run folder's session.

Code outside ``eval/`` imports these names from here, not from the modules inside.
"""

from __future__ import annotations

from criticalkv.eval.sweep.config import CACHE_OPTIONS, SweepConfig, head_scores_fingerprint, row_spec
from criticalkv.eval.sweep.config_rows import Continuation, RowOutcome, decode_configs, reference_logprobs
from criticalkv.eval.sweep.fidelity import Fidelity, fidelity
from criticalkv.eval.sweep.folder_hold import record_unusable, sweep_folder
from criticalkv.eval.sweep.runner import run_sweep
from criticalkv.eval.sweep.unit import SampleEvaluator, UnitItem, pending_pairs, record_key

__all__ = [
    "CACHE_OPTIONS",
    "Continuation",
    "Fidelity",
    "RowOutcome",
    "SampleEvaluator",
    "SweepConfig",
    "UnitItem",
    "decode_configs",
    "fidelity",
    "head_scores_fingerprint",
    "pending_pairs",
    "record_key",
    "record_unusable",
    "reference_logprobs",
    "row_spec",
    "run_sweep",
    "sweep_folder",
]
