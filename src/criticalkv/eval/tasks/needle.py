"""A single-needle retrieval task (RULER's niah_single_1 shape) for any tokenizer and length."""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from criticalkv.datafiles import word_list
from criticalkv.headscores.haystack import needle_in_noise, needle_question, needle_sentence

#: the keys a needle is named by (``data/words/needle_keys.txt``)
_KEYS = word_list("needle_keys")


@dataclass(frozen=True)
class NeedleSample:
    """One retrieval sample: find ``answer`` for ``key`` in ``context``."""

    context: str
    question: str
    answer: str
    key: str
    depth: float


def make_needle_sample(
    tokenizer: PreTrainedTokenizerBase, length: int, seed: int, depth: float | None = None
) -> NeedleSample:
    """A context of about ``length`` tokens of noise with one 7-digit magic number in it.

    Deterministic given ``seed``; ``depth`` (0..1) places the needle, random if ``None``.
    """
    if length < 32:
        raise ValueError(f"a needle context needs at least 32 tokens, not {length}")
    rng = random.Random(seed)
    key = rng.choice(_KEYS)
    answer = str(rng.randint(1_000_000, 9_999_999))
    depth = rng.random() if depth is None else depth
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], not {depth}")
    context = needle_in_noise(tokenizer, length, needle_sentence(key, answer), depth, sized_with_space=True)
    question = needle_question(key)
    return NeedleSample(context, question, answer, key, depth)


def digit_credit(prediction: str, answer: str) -> float:
    """Share of the answer's digits reproduced in place by the first number in ``prediction``."""
    digits = "".join(ch for ch in prediction if ch.isdigit())
    if not answer:
        return 0.0
    start = prediction.find(answer[0]) if answer[0] in prediction else -1
    if answer in digits:
        return 1.0
    if start < 0:
        return 0.0
    found = "".join(ch for ch in prediction[start:] if ch.isdigit())[: len(answer)]
    return sum(a == b for a, b in zip(found, answer, strict=False)) / len(answer)


def exact_match(prediction: str, answer: str) -> float:
    """1.0 if the answer string occurs in the prediction (RULER's string_match_all for one answer)."""
    return float(answer in prediction)
