"""Needle-retrieval samples for head scoring, tokenised, with the needle and answer located.

Each sample is a haystack of RULER's noise sentences with one needle, ``One of the special
magic numbers for {key} is: {number}.``, at a given depth; the question asks for the key's
number and the prompt ends with an answer prefix (``The special magic number for {key} is``),
so the next tokens the model should produce are the number's. The number is appended
(teacher forcing): one forward pass shows what each head attends to while the model produces
each answer token, and whether greedy decoding would have produced it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from criticalkv.datafiles import word_list
from criticalkv.headscores.haystack import needle_in_noise, needle_question, needle_sentence
from criticalkv.prompts import split_prompt

#: the two halves of a needle's ``adjective-noun`` key (``data/words/scoring_*.txt``)
_ADJECTIVES = word_list("scoring_adjectives")
_NOUNS = word_list("scoring_nouns")


@dataclass(frozen=True)
class RetrievalSample:
    """One tokenised scoring sample.

    Attributes
    ----------
    input_ids : the prompt followed by the answer tokens.
    prompt_len : tokens before the answer; the answer is ``input_ids[prompt_len:]``.
    needle : ``(start, end)`` token span of the needle sentence in ``input_ids``.
    key, answer : the needle's key and number.
    length, depth : the requested context length in tokens and the needle's relative depth.
    """

    input_ids: list[int]
    prompt_len: int
    needle: tuple[int, int]
    key: str
    answer: str
    length: int
    depth: float

    @property
    def answer_ids(self) -> list[int]:
        return self.input_ids[self.prompt_len :]


def _token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """The span of tokens whose characters overlap ``[start, end)`` (empty-offset tokens ignored)."""
    inside = [i for i, (s, e) in enumerate(offsets) if e > s and s < end and e > start]
    if not inside:
        raise ValueError("could not locate the needle in the tokenised prompt")
    return inside[0], inside[-1] + 1


def make_retrieval_sample(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int, chat: bool = True
) -> RetrievalSample:
    """A sample of about ``length`` context tokens with its needle at ``depth`` (0 = first).

    Deterministic given the arguments. Needs a fast tokenizer (character offsets).
    """
    if length < 64:
        raise ValueError(f"a scoring context needs at least 64 tokens, not {length}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], not {depth}")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("head scoring needs a fast tokenizer (it locates the needle by character offsets)")
    rng = random.Random(seed)
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    answer = str(rng.randint(1_000_000, 9_999_999))
    needle = needle_sentence(key, answer)
    context = needle_in_noise(tokenizer, length, needle, depth)
    question = needle_question(key)
    head, tail = split_prompt(tokenizer, context, question, chat)
    prefix = f"The special magic number for {key} is "
    if tail and not tail[-1].isspace():  # e.g. "Answer:" without a chat template
        prefix = " " + prefix
    text = head + tail + prefix + answer
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    offsets = [(int(a), int(b)) for a, b in encoded["offset_mapping"]]
    needle_at = head.index(needle)
    span = _token_span(offsets, needle_at, needle_at + len(needle))
    answer_at = len(text) - len(answer)
    prompt_len = _token_span(offsets, answer_at, len(text))[0]
    if not span[1] <= prompt_len < len(ids):
        raise ValueError("could not locate the needle and the answer in the tokenised prompt")
    return RetrievalSample(ids, prompt_len, span, key, answer, length, depth)
