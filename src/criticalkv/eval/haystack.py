"""Haystacks: RULER's repeated noise sentences and an offline public-domain natural text.

The natural-text haystack is the Book of Genesis, King James Version (1611, public domain),
extracted from Debian's ``bible-kjv-text`` package (``bible -f "Genesis 1:1-50:26"``) and
shipped as ``criticalkv/data/haystack_kjv_genesis.txt`` (38 thousand words, about 50 thousand
tokens). RULER uses Paul Graham's essays, which are not public domain.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The natural-text haystack as a tuple of words."""
    text = resources.files("criticalkv").joinpath("data/haystack_kjv_genesis.txt").read_text(encoding="utf-8")
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


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
