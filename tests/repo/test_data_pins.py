"""Pins: the word lists, LongBench tables, haystacks and needle samples stay byte-identical.

The digests were computed from the code before these moved to ``criticalkv/data``; a resumed
sweep regenerates its samples, so any change here would silently change the records.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict
from typing import Any

import pytest

from criticalkv.bench.prompt import bench_prompts
from criticalkv.eval.longbench import tasks
from criticalkv.eval.tasks import (
    NOISE,
    TASK_NAMES,
    essay_sentences,
    essay_words,
    make_needle_sample,
    make_sample,
    words,
)
from criticalkv.headscores.needles import make_retrieval_sample
from tests.helpers.tiny_tokenizer import char_tokenizer


def _digest(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=False, default=list)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return char_tokenizer()


def test_word_lists() -> None:
    assert (len(words.ADJECTIVES), words.ADJECTIVES[0], words.ADJECTIVES[-1]) == (212, "able", "zealous")
    assert (len(words.NOUNS), words.NOUNS[0], words.NOUNS[-1]) == (196, "acorn", "zebra")
    assert _digest(words.ADJECTIVES) == "a07b92782bbfb933"
    assert _digest(words.NOUNS) == "f469636c2a44df87"
    assert _digest(words.all_words()) == "035921b03100025e"
    assert _digest(words.distinct_keys(random.Random(0), 50)) == "f6e84bf53ba42d99"
    assert isinstance(words.ADJECTIVES, list) and isinstance(words.NOUNS, list)


def test_longbench_tables() -> None:
    names = [tasks.DATASETS, tasks.E_DATASETS, tasks.ZH_DATASETS, tasks.EN_DATASETS, tasks.GROUPS]
    assert _digest(names) == "290ed5de1f382e93"
    assert _digest([sorted(tasks.NO_CHAT), sorted(tasks.FIRST_LINE)]) == "eeb534d990a90fd2"
    assert _digest(list(tasks.MAX_NEW_TOKENS.items())) == "c82871a48baa41d4"
    assert _digest(list(tasks.METRIC.items())) == "3331486b275c4096"
    assert _digest(list(tasks.PROMPTS.items())) == "5fbfbb99c1c4d30c"
    assert _digest([tasks.split_template(d, "Q?") for d in tasks.DATASETS]) == "92f3c42d15fc3662"
    assert isinstance(tasks.DATASETS, tuple) and isinstance(tasks.NO_CHAT, frozenset)


def test_haystacks(tok) -> None:  # type: ignore[no-untyped-def]
    assert NOISE == "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    assert (len(essay_words()), essay_words()[0], essay_words()[-1]) == (38265, "In", "Egypt.")
    assert _digest(essay_words()) == "3473e2f372967501"
    assert _digest(essay_sentences(5000)) == "2a687f1e8810a7e0"
    assert _digest(bench_prompts(tok, 300, 3).tolist()) == "cef74e7fddc78819"


def test_needle_samples(tok) -> None:  # type: ignore[no-untyped-def]
    eval_samples = [asdict(make_needle_sample(tok, n, seed=s)) for n in (32, 500, 2048) for s in range(4)]
    eval_samples.append(asdict(make_needle_sample(tok, 700, seed=3, depth=0.25)))
    assert _digest(eval_samples) == "49644629544661d4"
    cases = [(n, d, s) for n in (64, 900) for d in (0.0, 0.5, 1.0) for s in (0, 5)]
    scoring = [asdict(make_retrieval_sample(tok, n, d, s, chat=False)) for n, d, s in cases]
    assert _digest(scoring) == "cbd3ee13077be188"


@pytest.mark.parametrize("task", TASK_NAMES)
def test_ruler_samples(task: str, tok) -> None:  # type: ignore[no-untyped-def]
    got = [asdict(make_sample(task, tok, 1200, index=i, seed=1)) for i in range(2)]
    assert _digest(got) == RULER[task]


RULER: dict[str, str] = {
    "niah_single_1": "d4971bb24402bb55",
    "niah_single_2": "e8de56670ee612d3",
    "niah_single_3": "73a89005d14c971e",
    "niah_multikey_1": "8f427c26caa93e29",
    "niah_multikey_2": "f34dd44855174e85",
    "niah_multikey_3": "d659ec4be555785a",
    "niah_multivalue": "61ab62e7d6e9d9d7",
    "niah_multiquery": "47c295679b4ecbec",
    "vt": "fb71ccf8233ec566",
    "cwe": "41f66d333055bb19",
    "fwe": "4e8351ba6a3d8739",
    "qa_1": "e4c9683a05e9165e",
    "qa_2": "01b0fe682eeb7049",
}


@pytest.mark.slow
def test_default_tokenizer_prompt_ids() -> None:
    """The demo's prompt token ids, head-score samples and benchmark prompts with the default tokenizer."""
    from criticalkv.models import load_tokenizer
    from criticalkv.prompts import encode_pair

    real = load_tokenizer("default")
    demo = [make_needle_sample(real, 2048, seed=i) for i in range(8)]
    assert _digest([encode_pair(real, s.context, s.question) for s in demo]) == "8a3f21751a63636e"
    scoring = [make_retrieval_sample(real, n, k / 9, s) for n in (1024, 2048) for k in range(10) for s in (0, 3)]
    assert _digest([asdict(s) for s in scoring]) == "27539403e9706362"
    assert _digest(bench_prompts(real, 1024, 2).tolist()) == "a8d9f34fa5319807"
