"""LongBench's middle truncation, applied to a prompt made of parts (head, context, tail).

``pred.py`` tokenises the whole prompt and, if it has more than ``max_length`` tokens, keeps the
first ``int(max_length / 2)`` and the last ``int(max_length / 2)`` tokens, decoding the two
halves separately ("truncate in the middle, since the left and right side may contain crucial
instructions"). Here the parts are tokenised separately (without special tokens) and the same
token positions are kept, so the cut lands where LongBench's does (in the context, unless the
context is shorter than the cut), and each part's surviving text is known: a part that is
kept whole keeps its exact text, a cut one is decoded from its kept tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Truncated:
    """The kept text of each part, the prompt's token count before and the tokens removed."""

    parts: list[str]
    tokens: int
    removed: int


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True)) if ids else ""


def middle_truncate(tokenizer: Any, parts: Sequence[str], max_length: int) -> Truncated:
    """Keep the first and last ``max_length // 2`` tokens of the concatenated ``parts``."""
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 tokens, not {max_length}")
    ids = [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in parts]
    n = sum(len(x) for x in ids)
    if n <= max_length:
        return Truncated(list(parts), n, 0)
    half = max_length // 2
    cut_from, cut_to = half, n - half  # token positions [cut_from, cut_to) are dropped
    kept: list[str] = []
    start = 0
    for text, toks in zip(parts, ids, strict=True):
        end = start + len(toks)
        if end <= cut_from or start >= cut_to:
            kept.append(text)  # entirely in the kept head or tail
        else:
            head = toks[: max(0, cut_from - start)]
            tail = toks[max(0, cut_to - start) :] if end > cut_to else []
            kept.append(_decode(tokenizer, head) + _decode(tokenizer, tail))
        start = end
    return Truncated(kept, n, cut_to - cut_from)
