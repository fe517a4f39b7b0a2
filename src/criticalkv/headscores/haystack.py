"""Haystacks and the single-needle-in-noise context that head scoring, the eval tasks and the bench share.

The noise haystack is RULER's repeated sentence (``data/haystack/noise.txt``). The natural-text
haystack is the Book of Genesis, King James Version (1611, public domain), extracted from
Debian's ``bible-kjv-text`` package (``bible -f "Genesis 1:1-50:26"``) and shipped as
``data/haystack/kjv_genesis.txt`` (38 thousand words, about 50 thousand tokens). RULER uses
Paul Graham's essays, which are not public domain.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING

from criticalkv.datafiles import read_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: RULER's noise haystack sentence
NOISE: str = read_text("haystack/noise.txt").rstrip("\n")
#: the instruction that opens a single-needle context
NEEDLE_INTRO = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards.\n"
)


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The natural-text haystack as a tuple of words."""
    return tuple(re.sub(r"\s+", " ", read_text("haystack/kjv_genesis.txt")).strip().split(" "))


def essay_sentences(num_words: int) -> list[str]:
    """The first ``num_words`` words of the natural text, split into sentences."""
    words = essay_words()
    if num_words > len(words):
        raise ValueError(
            f"the natural-text haystack has {len(words)} words; {num_words} were requested "
            "(use a shorter length or the noise haystack)"
        )
    text = " ".join(words[:num_words])
    return [s for s in re.split(r"(?<=[.;:?!])\s+", text) if s]


def needle_sentence(key: str, number: str) -> str:
    """The needle: ``One of the special magic numbers for {key} is: {number}.``"""
    return f"One of the special magic numbers for {key} is: {number}."


def needle_question(key: str) -> str:
    """The question that asks for the needle's number."""
    return f"What is the special magic number for {key} mentioned in the provided text?"


def needle_in_noise(
    tokenizer: PreTrainedTokenizerBase, length: int, needle: str, depth: float, *, sized_with_space: bool = False
) -> str:
    """:data:`NEEDLE_INTRO` and about ``length`` tokens of :data:`NOISE` with ``needle`` at ``depth`` (0..1).

    The noise is repeated as often as fits beside the intro and the needle; ``sized_with_space``
    counts the needle's tokens with a leading space (how :mod:`criticalkv.eval.tasks.needle` sizes it).
    """
    per_noise = len(tokenizer(" " + NOISE, add_special_tokens=False)["input_ids"])
    sized = (" " if sized_with_space else "") + needle
    fixed = len(tokenizer(NEEDLE_INTRO + sized, add_special_tokens=False)["input_ids"])
    repeats = max(1, (length - fixed) // max(per_noise, 1))
    sentences = [NOISE] * repeats
    sentences.insert(round(depth * repeats), needle)
    return NEEDLE_INTRO + " ".join(sentences)
