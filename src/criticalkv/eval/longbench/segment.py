"""Chinese word segmentation for LongBench's Chinese metrics (jieba, an optional dependency).

``qa_f1_zh_score`` and ``rouge_zh_score`` segment with ``jieba.cut(text, cut_all=False)``, as
LongBench does. There is no silent fallback (character-level scores are not comparable with
published numbers): without jieba those two metrics raise :class:`MissingJieba`, and a sweep
over ``multifieldqa_zh``, ``dureader`` or ``vcsum`` is refused before it starts.
"""

from __future__ import annotations

import importlib
import logging
from functools import cache
from types import ModuleType

#: the datasets whose metric segments Chinese text
NEEDS_JIEBA: frozenset[str] = frozenset({"multifieldqa_zh", "dureader", "vcsum"})

INSTALL_HINT = "pip install -e '.[longbench]' (in a clone; or: pip install 'jieba>=0.42')"


class MissingJieba(ImportError, ValueError):
    """jieba is not installed; raised with the command that installs it."""


@cache
def _jieba() -> ModuleType:
    try:
        module = importlib.import_module("jieba")
    except ImportError as err:
        raise MissingJieba(
            f"LongBench's Chinese metrics (qa_f1_zh_score, rouge_zh_score) segment words with jieba, "
            f"which is not installed: {INSTALL_HINT}"
        ) from err
    module.setLogLevel(logging.WARNING)  # jieba logs its dictionary loading at INFO
    return module


def forget_jieba() -> None:
    """Forget whether jieba was found, as a fresh process would (after installing it, or in tests
    that hide it)."""
    _jieba.cache_clear()


def require_jieba() -> None:
    """Raise :class:`MissingJieba` if jieba cannot be imported."""
    _jieba()


def cut(text: str) -> list[str]:
    """``list(jieba.cut(text, cut_all=False))``."""
    return list(_jieba().cut(text, cut_all=False))
