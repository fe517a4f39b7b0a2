"""Turning a user budget (a fraction or a token count) into entries per head."""

from __future__ import annotations

import math

import torch

from criticalkv.options import OptionError, OptionTypeError

Budget = float | int


def validate_budget(budget: object) -> Budget:
    """Check a budget's type and range without knowing the context.

    A ``float`` is a fraction of the context in (0, 1]; an ``int`` is a token count >= 1.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise OptionTypeError(
            "<budget> must be a fraction in (0, 1] (a float) or a token count (an int), not {budget!r}", budget=budget
        )
    if isinstance(budget, float):
        if not math.isfinite(budget) or not 0.0 < budget <= 1.0:
            raise OptionError(
                "<budget> {budget} is not a fraction in (0, 1]; pass e.g. 0.2 for 20% of the context, "
                "or an integer token count such as 512",
                budget=budget,
            )
    elif budget < 1:
        raise OptionError(
            "<budget> {budget} tokens is below 1; pass a positive token count or a fraction", budget=budget
        )
    return budget


def parse_budget(text: str) -> Budget:
    """Parse a command-line budget: ``"0.2"`` is a fraction, ``"512"`` a token count."""
    text = text.strip()
    try:
        value: Budget = int(text) if text.lstrip("+").isdigit() else float(text)
    except ValueError as err:
        raise ValueError(f"budget {text!r} is neither a fraction like 0.2 nor a token count like 512") from err
    return validate_budget(value)


def resolve_budget(budget: Budget, lengths: torch.Tensor, window: int) -> torch.Tensor:
    """Entries per head, per row: ``floor(fraction * length)`` or the token count.

    Parameters
    ----------
    budget : a fraction in (0, 1] or a token count.
    lengths : (B,) real tokens per row of the compressed prompt.
    window : the observation window, which the budget must hold.

    Returns
    -------
    (B,) int64 tensor.
    """
    budget = validate_budget(budget)
    lengths = lengths.long()
    shortest = int(lengths.min())
    if isinstance(budget, float):
        per_row = torch.clamp(torch.floor(budget * lengths.double()).long(), min=1)
    else:
        if budget > shortest:
            raise ValueError(
                f"budget {budget} tokens exceeds the context length ({shortest} tokens); "
                "pass at most the context length, or a fraction"
            )
        per_row = torch.full_like(lengths, budget)
    smallest = int(per_row.min())
    if smallest < window:
        raise ValueError(
            f"the budget ({smallest} tokens per head) is smaller than the observation window "
            f"({window} tokens), which is always kept; raise the budget or lower the window"
        )
    return per_row
