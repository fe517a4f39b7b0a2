"""What the perturbation experiment compares: each base method and its Critical variant, per budget."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from criticalkv.budgets.resolve import Budget, validate_budget
from criticalkv.methods import available_methods, get_method

CRITICAL_PREFIX = "critical-"
#: the comparisons the paper reports
DEFAULT_BASES = ("snapkv", "adakv")
DEFAULT_BUDGETS: tuple[Budget, ...] = (0.025, 0.05, 0.1, 0.2, 0.4)


@dataclass(frozen=True)
class Config:
    """One compression to measure: ``method`` at ``budget``, compared with ``base`` if it is a variant."""

    method: str
    budget: Budget
    base: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.method, str(self.budget)


def critical_variant(base: str) -> str:
    """The registered Critical variant of a base method (``snapkv`` -> ``critical-snapkv``).

    Raises
    ------
    ValueError
        If ``base`` is unknown, is itself a Critical variant, does not compress, or has no
        registered Critical variant.
    """
    method = get_method(base)
    if method.name.startswith(CRITICAL_PREFIX):
        raise ValueError(
            f"{method.name!r} is a Critical variant; pass its base method "
            f"({method.name[len(CRITICAL_PREFIX) :]!r}): each base is compared with its Critical variant"
        )
    if not method.compresses:
        raise ValueError(f"{method.name!r} keeps every entry (nothing to compare); pass a compressing base method")
    variant = CRITICAL_PREFIX + method.name
    if variant not in available_methods():
        bases = [m[len(CRITICAL_PREFIX) :] for m in available_methods() if m.startswith(CRITICAL_PREFIX)]
        raise ValueError(f"{method.name!r} has no registered Critical variant; choose among: {', '.join(bases)}")
    return variant


def comparison_configs(bases: Sequence[str], budgets: Sequence[Budget]) -> list[Config]:
    """Each base method and its Critical variant at each budget (the same per-head budgets)."""
    if not bases:
        raise ValueError("no base methods given; pass e.g. snapkv,adakv")
    if not budgets:
        raise ValueError("no budgets given; pass e.g. 0.05,0.1,0.2")
    configs = []
    for base in dict.fromkeys(bases):
        variant = critical_variant(base)
        for budget in dict.fromkeys(validate_budget(b) for b in budgets):
            configs += [Config(base, budget), Config(variant, budget, base=base)]
    return configs


def check_budgets(budgets: Sequence[Budget], length: int, window: int) -> None:
    """Refuse budgets that cannot hold the observation window on a context of ``length`` tokens.

    Raises
    ------
    ValueError
        Naming the budget, the tokens it stands for and the window.
    """
    for budget in budgets:
        budget = validate_budget(budget)
        if isinstance(budget, float):
            tokens = math.floor(budget * length)
            what = f"budget {budget} of {length} tokens is {tokens} tokens"
        else:
            tokens, what = budget, f"budget {budget} tokens is"
        if tokens < window:
            raise ValueError(
                f"{what}, below the observation window ({window} tokens), which every method keeps; "
                "raise the budget, lengthen the context or lower --window"
            )
