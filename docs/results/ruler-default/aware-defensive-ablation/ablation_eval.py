"""Ablation of DefensiveKV's parts on the question-aware RULER prompts: `criticalkv eval` with three
extra registered variants (value norms in exact float32, as in the other result folders)."""

import dataclasses
import sys

from criticalkv.budgets import Adaptive
from criticalkv.cli import main
from criticalkv.methods import Method, available_methods, get_method, register
from criticalkv.scores import DefensiveAggregation, WindowAttention
from criticalkv.select import AdaptiveCritical, Critical

REF = "ablation of Feng et al. 2025, DefensiveKV (arXiv 2510.13334)"


def exact(method: Method) -> Method:
    if hasattr(method.select, "precision"):
        method = dataclasses.replace(method, select=dataclasses.replace(method.select, precision="exact"))
    return method


def constant(method):
    return lambda: method


for name in available_methods():
    register(name, constant(exact(get_method(name))))
variants = {
    # DefensiveKV without the window correction: stage 1 asks 90% of the non-window mass
    "defensivekv-no-window-correction": Method(
        "defensivekv-no-window-correction",
        "",
        REF,
        DefensiveAggregation(),
        Adaptive(0.0),
        AdaptiveCritical(window_correction=False),
    ),
    # DefensiveKV's selection and budgets on SnapKV's mean aggregation
    "defensivekv-mean-aggregation": Method(
        "defensivekv-mean-aggregation", "", REF, WindowAttention(), Adaptive(0.0), AdaptiveCritical()
    ),
    # the defensive aggregation alone, on CriticalAdaKV's budgets and selection
    "critical-adakv-defensive-aggregation": Method(
        "critical-adakv-defensive-aggregation", "", REF, DefensiveAggregation(), Adaptive(), Critical()
    ),
}
for name, method in variants.items():
    register(name, constant(exact(method)))
sys.exit(main(["eval", *sys.argv[1:]]))
