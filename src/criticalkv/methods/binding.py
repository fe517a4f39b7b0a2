"""Binding a method to a model: its head scores, once, before a cache exists."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from criticalkv.budgets.base import HeadScoredAllocator
from criticalkv.headscores.file import HeadScores, load_head_scores
from criticalkv.headscores.lookup import find_head_scores
from criticalkv.methods.method import Method

HeadScoresArg = str | Path | HeadScores | None


def bind(method: Method, model: Any = None, head_scores: HeadScoresArg = None) -> Method:
    """``method`` with everything it needs from a model bound: its head-prior budgets' scores.

    Methods that need nothing from a model come back unchanged (``head_scores`` is then
    ignored), as do already bound methods when no ``head_scores`` is given.

    Parameters
    ----------
    method : a :class:`Method`, e.g. ``get_method("headkv")``.
    model : a transformers model or its config; ``None`` binds ``head_scores`` without an
        architecture check (the budgets still check the number of layers and KV heads).
    head_scores : a path, a :class:`HeadScores`, or ``None`` to look the model's up (see
        :func:`criticalkv.headscores.find_head_scores`).
    """
    if not method.needs.head_scores or (head_scores is None and method.bound):
        return method
    config = model.config if model is not None and not _is_config(model) else model
    if config is not None:
        scores = find_head_scores(config, head_scores)
    elif head_scores is not None:
        scores = head_scores if isinstance(head_scores, HeadScores) else load_head_scores(head_scores)
    else:
        raise ValueError(
            f"method {method.name!r} needs head importance scores and there is no model to look them up for; "
            "pass head_scores='scores.json' (see `criticalkv head-scores --help`)"
        )
    budgets = cast(HeadScoredAllocator, method.budgets).with_head_scores(scores.matrix())
    return replace(method, budgets=budgets)


def _is_config(model: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(model, PretrainedConfig)
