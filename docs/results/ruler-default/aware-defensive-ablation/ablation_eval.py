"""Ablation of DefensiveKV's parts on the question-aware RULER prompts: `criticalkv eval` with three
extra registered variants, value norms in exact float32 (`--norm-precision exact`), as in the
other result folders.

    python ablation_eval.py --methods full,defensivekv,layer-defensivekv,defensivekv-no-window-correction,\
defensivekv-mean-aggregation,critical-adakv-defensive-aggregation --budgets 0.2 --samples 2 \
--mode question-aware --max-new-tokens 32 --out docs/results/ruler-default/aware-defensive-ablation
"""

import sys

from criticalkv.budgets import Adaptive
from criticalkv.cli import main
from criticalkv.methods import Method, register
from criticalkv.scores import DefensiveAggregation, WindowAttention
from criticalkv.select import AdaptiveCritical, Critical

REF = "ablation of Feng et al. 2025, DefensiveKV (arXiv 2510.13334)"

variants = {
    # DefensiveKV without the window correction: stage 1 asks 90% of the non-window mass
    "defensivekv-no-window-correction": (
        DefensiveAggregation(),
        Adaptive(0.0),
        AdaptiveCritical(window_correction=False),
    ),
    # DefensiveKV's selection and budgets on SnapKV's mean aggregation
    "defensivekv-mean-aggregation": (WindowAttention(), Adaptive(0.0), AdaptiveCritical()),
    # the defensive aggregation alone, on CriticalAdaKV's budgets and selection
    "critical-adakv-defensive-aggregation": (DefensiveAggregation(), Adaptive(), Critical()),
}
for name, (scores, budgets, select) in variants.items():
    register(Method(name, "", REF, scores, budgets, select))
sys.exit(main(["eval", "--norm-precision", "exact", *sys.argv[1:]]))
