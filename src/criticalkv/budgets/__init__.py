"""Budgets: how many entries each (batch row, KV head) keeps."""

from criticalkv.budgets.adaptive import Adaptive
from criticalkv.budgets.base import Allocator
from criticalkv.budgets.head_prior import HeadPrior
from criticalkv.budgets.pyramid import Pyramid
from criticalkv.budgets.resolve import resolve_budget, validate_budget
from criticalkv.budgets.uniform import Uniform

__all__ = ["Adaptive", "Allocator", "HeadPrior", "Pyramid", "Uniform", "resolve_budget", "validate_budget"]
