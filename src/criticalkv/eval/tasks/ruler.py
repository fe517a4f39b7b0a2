"""RULER's 13 synthetic tasks (Hsieh et al. 2024, arXiv 2404.06654) for any tokenizer and length.

Templates, answer prefixes, needle formats, task parameters and metrics follow RULER's
``synthetic.yaml`` and ``constants.py``. Differences: the natural-text haystack is public-domain
text shipped with the package (see :mod:`criticalkv.headscores.haystack`); ``vt`` and ``cwe`` have
no in-context example; ``qa_1``/``qa_2`` use SQuAD/HotpotQA when given (``qa_source``) and otherwise
an offline synthetic multi-document QA of the same shape (:mod:`criticalkv.eval.tasks.qa_data`).
The requested length is the prompt's token count without the chat template.
"""

from __future__ import annotations

import random
import string
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from criticalkv.eval.sample import Sample
from criticalkv.eval.tasks.qa_data import qa_documents
from criticalkv.eval.tasks.words import ADJECTIVES, NOUNS, distinct_keys
from criticalkv.headscores.haystack import NOISE, essay_sentences, essay_words

Builder = Callable[[random.Random, int], tuple[str, str, list[str], str, dict[str, Any]]]


@dataclass(frozen=True)
class NiahConfig:
    haystack: str  # repeat | essay | needle
    key_type: str  # words | numbers | uuids
    value_type: str  # numbers | words | uuids
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH_TASKS: dict[str, NiahConfig] = {
    "niah_single_1": NiahConfig("repeat", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_keys=4, num_queries=4),
}
#: RULER's tokens_to_generate per task family
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
TASK_NAMES: tuple[str, ...] = (*NIAH_TASKS, "vt", "cwe", "fwe", "qa_1", "qa_2")


def _value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return distinct_keys(rng, 1)[0]
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _key(rng: random.Random, kind: str) -> str:
    return distinct_keys(rng, 1)[0] if kind == "words" else _value(rng, kind)


def _niah_builder(cfg: NiahConfig) -> Builder:
    def build(rng: random.Random, size: int) -> tuple[str, str, list[str], str, dict[str, Any]]:
        num_keys = max(cfg.num_keys, cfg.num_queries)
        keys = (
            distinct_keys(rng, num_keys)
            if cfg.key_type == "words"
            else [_value(rng, cfg.key_type) for _ in range(num_keys)]
        )
        kind = cfg.value_type
        values = [[_value(rng, kind) for _ in range(cfg.num_values)] for _ in keys]
        needles = [
            f"One of the special magic {kind} for {k} is: {v}." for k, vs in zip(keys, values, strict=True) for v in vs
        ]
        rng.shuffle(needles)
        if cfg.haystack == "essay":
            sentences = essay_sentences(size)
            cuts = sorted(int(len(sentences) * rng.randint(0, 100) / 100) for _ in needles)
            for offset, (cut, needle) in enumerate(zip(cuts, needles, strict=True)):
                sentences.insert(cut + offset, needle)
            haystack = " ".join(sentences)
        else:
            if cfg.haystack == "repeat":
                sentences = [NOISE] * size
            else:
                sentences = [
                    f"One of the special magic {kind} for {_key(rng, cfg.key_type)} is: {_value(rng, kind)}."
                    for _ in range(size)
                ]
            for index, needle in zip(
                sorted(rng.sample(range(size + 1), len(needles)), reverse=True), needles, strict=True
            ):
                sentences.insert(index, needle)
            haystack = "\n".join(sentences)
        picked = rng.sample(range(num_keys), cfg.num_queries)
        queries = [keys[i] for i in picked]
        answers = [v for i in picked for v in values[i]]
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        single = cfg.num_queries * cfg.num_values == 1
        noun = kind[:-1] if single else kind
        intro = (
            f"{'A' if single else 'Some'} special magic {noun} {'is' if single else 'are'} hidden within the following "
            f"text. Make sure to memorize it. I will quiz you about the {noun} afterwards."
        )
        question = (
            f"What {'is' if single else 'are all'} the special magic {noun} for {query} mentioned in the provided text?"
        )
        prefix = f"The special magic {noun} for {query} mentioned in the provided text {'is' if single else 'are'}"
        return intro + "\n" + haystack, question, answers, prefix, {"num_needles": len(needles)}

    return build


def _vt(rng: random.Random, size: int) -> tuple[str, str, list[str], str, dict[str, Any]]:
    num_hops = 4
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(num_hops)]
    sentences = [NOISE] * max(size, len(chain))
    positions = sorted(rng.sample(range(len(sentences) + 1), len(chain)))
    for offset, (pos, statement) in enumerate(zip(positions, chain, strict=True)):
        sentences.insert(pos + offset, statement + ".")
    context = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n" + "\n".join(
        sentences
    )
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"Answer: According to the chain(s) of variable assignment in the text above, {num_hops + 1} variables are "
        f"assigned the value {value}, they are:"
    )
    return context, question, names, prefix, {}


def _cwe(rng: random.Random, size: int, long_form: bool) -> tuple[str, str, list[str], str, dict[str, Any]]:
    pool = sorted(set(ADJECTIVES) | set(NOUNS))
    num_words = min(max(size, 11), len(pool))
    chosen = rng.sample(pool, num_words)
    common, uncommon = chosen[:10], chosen[10:]
    freq_common, freq_uncommon = (30, 3) if long_form else (6, 1)
    words = common * freq_common + uncommon * freq_uncommon
    rng.shuffle(words)
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    context = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n" + listing
    )
    question = "Question: What are the 10 most common words in the above list?"
    prefix = "Answer: The top 10 words that appear most often in the list are:"
    return context, question, common, prefix, {}


def _fwe(rng: random.Random, size: int, vocab_size: int) -> tuple[str, str, list[str], str, dict[str, Any]]:
    alpha = 2.0
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < vocab_size:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    vocab[0] = "..."  # the top-ranked word is noise
    zeta = sum(k**-alpha for k in range(1, 10_000))
    counts = [int(size * (k**-alpha) / zeta) for k in range(1, vocab_size + 1)]
    words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
    rng.shuffle(words)
    context = (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. " + " ".join(words)
    )
    question = (
        "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently "
        "appeared words in the above coded text?"
    )
    prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
    return context, question, vocab[1:4], prefix, {}


_QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)


def _qa_builder(hops: int, source: str | None) -> Builder:
    def build(rng: random.Random, size: int) -> tuple[str, str, list[str], str, dict[str, Any]]:
        docs, question, answers, used = qa_documents(rng, size, hops=hops, source=source)
        listing = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        instruction = _QA_INSTRUCTION
        context = f"{instruction}\n\nThe following are given documents.\n\n{listing}"
        return context, f"{instruction}\n\nQuestion: {question}", answers, "Answer:", {"qa_source": used}

    return build


def _builder(task: str, length: int, qa_source: str | None) -> tuple[Builder, str, int]:
    """(builder, metric, max_new_tokens) of a task."""
    if task in NIAH_TASKS:
        return _niah_builder(NIAH_TASKS[task]), "string_match_all", TOKENS_TO_GENERATE["niah"]
    if task == "vt":
        return _vt, "string_match_all", TOKENS_TO_GENERATE["vt"]
    if task == "cwe":
        return (lambda r, s: _cwe(r, s, long_form=length >= 4096)), "string_match_all", TOKENS_TO_GENERATE["cwe"]
    if task == "fwe":
        vocab = max(length // 50, 10)
        return (lambda r, s: _fwe(r, s, vocab)), "string_match_all", TOKENS_TO_GENERATE["fwe"]
    if task in ("qa_1", "qa_2"):
        return _qa_builder(1 if task == "qa_1" else 2, qa_source), "string_match_part", TOKENS_TO_GENERATE["qa"]
    raise ValueError(f"unknown RULER task {task!r}; choose from: {', '.join(TASK_NAMES)}")


def _seed(task: str, length: int, index: int, seed: int) -> int:
    return zlib.crc32(f"{task}|{length}|{index}|{seed}".encode())


def make_sample(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    index: int,
    *,
    seed: int = 0,
    qa_source: str | None = None,
) -> Sample:
    """Sample ``index`` of a RULER task whose prompt (context + question) has about ``length`` tokens.

    Deterministic in (task, length, index, seed). The haystack size is found by bisection so
    the prompt is the largest that fits in ``length`` tokens.
    """
    if length < 128:
        raise ValueError(f"RULER lengths start at 128 tokens, not {length}")
    build, metric, max_new = _builder(task, length, qa_source)

    def render(size: int) -> tuple[tuple[str, str, list[str], str, dict[str, Any]], int]:
        parts = build(random.Random(_seed(task, length, index, seed)), size)
        n = len(tokenizer(parts[0] + "\n" + parts[1], add_special_tokens=False)["input_ids"])
        return parts, n

    cap = (
        len(essay_words())
        if task in ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")
        else 1 << 20
    )
    lo, hi = 1, 16
    while hi < cap and render(hi)[1] <= length:
        lo, hi = hi, min(hi * 2, cap)
    if render(hi)[1] <= length:
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if render(mid)[1] <= length:
            lo = mid
        else:
            hi = mid
    (context, question, answers, prefix, meta), n = render(lo)
    if n > length * 1.05 + 16:
        raise ValueError(f"task {task} cannot fit in {length} tokens (its smallest prompt has {n})")
    meta = {**meta, "prompt_tokens": n, "haystack_size": lo}
    return Sample(task, index, context, question, answers, metric, max_new, prefix, meta)
