"""The one check that an input fits the model's positions, before any work is done."""

from __future__ import annotations

from typing import Any


def position_limit(model: Any) -> int | None:
    """The most positions ``model`` takes (``config.max_position_embeddings``; ``None``: no limit known)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_positions(model: Any, prompt_tokens: int, new_tokens: int = 0, *, what: str = "the prompt", fix: str) -> None:
    """Refuse ``prompt_tokens`` plus ``new_tokens`` positions beyond the model's limit.

    Raises
    ------
    ValueError
        A sentence naming the token count, the model's limit and ``fix`` (what to change).
    """
    limit = position_limit(model)
    needed = prompt_tokens + new_tokens
    if limit is None or needed <= limit:
        return
    plus = f" plus {new_tokens} new tokens" if new_tokens else ""
    raise ValueError(
        f"{what} has {prompt_tokens} tokens{plus}: {needed} positions, more than the {limit} this model takes "
        f"(config.max_position_embeddings); {fix}"
    )
