"""Word lists for keys and distractors (RULER uses adjective-noun pairs such as ``quiet-meadow``).

The lists are ``data/words/adjectives.txt`` and ``data/words/nouns.txt``, one word per line.
"""

from __future__ import annotations

import random

from criticalkv.datafiles import word_list

ADJECTIVES: list[str] = word_list("adjectives")
NOUNS: list[str] = word_list("nouns")


def random_key(rng: random.Random) -> str:
    """An ``adjective-noun`` key such as ``quiet-meadow``."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def distinct_keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct adjective-noun keys."""
    keys: list[str] = []
    while len(keys) < n:
        key = random_key(rng)
        if key not in keys:
            keys.append(key)
    return keys


def all_words() -> list[str]:
    """Every adjective-noun pair, sorted (the pool for word-list tasks)."""
    return sorted({f"{a}-{n}" for a in ADJECTIVES for n in NOUNS})
