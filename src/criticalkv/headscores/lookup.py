"""Finding a model's head scores (bound to a method by :func:`criticalkv.methods.bind`).

Where the scores come from, in order:

1. ``head_scores=`` given explicitly: a path or a :class:`HeadScores` (checked against the model);
2. the per-model cache file, ``cache_dir()/head_scores/<model>--<fingerprint>.json``, written by
   ``criticalkv head-scores`` for exactly this model (name and architecture);
3. a file shipped with criticalkv (``criticalkv/data/head_scores/``) whose architecture
   fingerprint matches: the default model's;
4. otherwise a :class:`ValueError` that says how to compute them.
"""

from __future__ import annotations

import logging
import re
from importlib import resources
from pathlib import Path
from typing import Any

from criticalkv.headscores.file import HeadScores, architecture, describe, fingerprint, load_head_scores
from criticalkv.models import cache_dir

logger = logging.getLogger(__name__)

HeadScoresArg = str | Path | HeadScores | None


def model_name(config: Any) -> str:
    """A model's name for score files: a hub id as is, a local folder by its name."""
    name = str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "") or "")
    if not name:
        return "unnamed"
    path = Path(name)
    return path.name if path.is_absolute() or path.exists() else name


def cache_path(config: Any, name: str | None = None) -> Path:
    """Where ``criticalkv head-scores`` caches the scores of the model with ``config``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name or model_name(config)).strip("-.") or "unnamed"
    return cache_dir() / "head_scores" / f"{slug}--{fingerprint(architecture(config))}.json"


def shipped_files() -> list[Path]:
    """The head-score files that ship with criticalkv."""
    folder = resources.files("criticalkv") / "data" / "head_scores"
    if not folder.is_dir():
        return []
    return sorted(Path(str(item)) for item in folder.iterdir() if item.name.endswith(".json"))


def _shipped_for(config: Any) -> HeadScores | None:
    wanted = fingerprint(architecture(config))
    for path in shipped_files():
        scores = load_head_scores(path)
        if scores.fingerprint == wanted:
            logger.info("using the head scores shipped for %s (%s)", scores.model, path.name)
            return scores
    return None


def find_head_scores(config: Any, head_scores: HeadScoresArg = None) -> HeadScores:
    """The head scores for the model with ``config`` (see the module docstring for the order).

    Raises
    ------
    ValueError
        If explicit scores belong to another architecture, or none are found.
    """
    if head_scores is not None:
        if isinstance(head_scores, HeadScores):
            scores, source = head_scores, f"the head scores of {head_scores.model}"
        elif isinstance(head_scores, (str, Path)):
            scores, source = load_head_scores(head_scores), f"the head scores in {head_scores}"
        else:
            raise TypeError(f"head_scores must be a path or a HeadScores, not {type(head_scores).__name__}")
        scores.check_model(config, source)
        return scores
    cached = cache_path(config)
    if cached.is_file():
        scores = load_head_scores(cached)
        scores.check_model(config, f"the cached head scores in {cached}")
        logger.info("using cached head scores %s", cached)
        return scores
    shipped = _shipped_for(config)
    if shipped is not None:
        return shipped
    name = model_name(config)
    raise ValueError(
        f"no head importance scores for {name} ({describe(architecture(config))}): none ship with criticalkv "
        f"and none are cached at {cached}. Compute them with `criticalkv head-scores --model "
        f"{'MODEL' if name == 'unnamed' else name} --out scores.json` (this also caches them), "
        "or pass head_scores='scores.json'"
    )
