"""Budgets: how many entries each (batch row, KV head) keeps."""

from criticalkv.budgets.adaptive import Adaptive
from criticalkv.budgets.base import Allocator, CrossLayerAllocator, HeadScoredAllocator
from criticalkv.budgets.head_prior import HeadPrior
from criticalkv.budgets.layer_joint import LayerJoint
from criticalkv.budgets.pyramid import Pyramid
from criticalkv.budgets.resolve import resolve_budget, validate_budget
from criticalkv.budgets.uniform import Uniform

__all__ = [
    "Adaptive",
    "Allocator",
    "CrossLayerAllocator",
    "HeadPrior",
    "HeadScoredAllocator",
    "LayerJoint",
    "Pyramid",
    "Uniform",
    "resolve_budget",
    "validate_budget",
]
