"""Documents and questions for RULER's QA tasks.

With ``source=None`` an offline synthetic multi-document QA is generated: documents about
fictional towns and people, the answer in one document (``qa_1``, SQuAD-like) or reached in two
hops through two documents (``qa_2``, HotpotQA-like), the rest distractors of the same shape.
Otherwise ``source`` names SQuAD- or HotpotQA-style data: a local JSONL file with lines
``{"context" or "paragraphs", "question", "answers"}``, or a ``datasets`` id / local dataset
folder (``rajpurkar/squad``, ``hotpotqa/hotpot_qa``) loaded through ``datasets`` when installed.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "dor",
    "vel",
    "th",
    "an",
    "is",
    "ur",
    "bel",
    "cor",
    "fen",
    "gar",
    "hal",
    "ith",
    "mor",
    "nal",
    "pen",
    "quil",
    "ros",
    "tav",
    "wen",
    "yor",
    "zel",
]
_GOODS = [
    "copper kettles",
    "wool blankets",
    "glass beads",
    "salted fish",
    "oak barrels",
    "clay pipes",
    "silk ribbons",
    "iron nails",
]
_TRADES = ["merchant", "sailor", "weaver", "miller", "scribe", "mason", "brewer", "carpenter"]


def _name(rng: random.Random, parts: int = 2) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def _person(rng: random.Random) -> str:
    return f"{_name(rng)} {_name(rng, 3)}"


def _synthetic(rng: random.Random, num_docs: int, hops: int) -> tuple[list[str], str, list[str]]:
    towns: list[dict[str, str]] = []
    used: set[str] = set()
    while len(towns) < max(num_docs, 2):
        town = _name(rng, 3)
        if town in used:
            continue
        used.add(town)
        towns.append(
            {
                "town": town,
                "founder": _person(rng),
                "year": str(rng.randint(1100, 1899)),
                "river": _name(rng) + " river",
                "goods": rng.choice(_GOODS),
                "birthplace": _name(rng, 3),
                "trade": rng.choice(_TRADES),
            }
        )
    docs = [
        f"{t['town']}\n{t['town']} is a town on the {t['river']}. It was founded in {t['year']} by {t['founder']}. "
        f"Its markets are known for {t['goods']}."
        for t in towns
    ]
    gold = rng.randrange(len(towns))
    t = towns[gold]
    if hops == 1:
        kind = rng.choice(["founder", "year", "river", "goods"])
        question = {
            "founder": f"Who founded {t['town']}?",
            "year": f"In which year was {t['town']} founded?",
            "river": f"On which river is {t['town']}?",
            "goods": f"What are the markets of {t['town']} known for?",
        }[kind]
        return docs, question, [t[kind]]
    bio = f"{t['founder']}\n{t['founder']} was a {t['trade']} born in {t['birthplace']}."
    docs.insert(rng.randrange(len(docs) + 1), bio)
    distractor = towns[(gold + 1) % len(towns)]
    other = distractor["founder"]
    docs.insert(
        rng.randrange(len(docs) + 1),
        f"{other}\n{other} was a {distractor['trade']} born in {distractor['birthplace']}.",
    )
    return docs, f"In which town was the founder of {t['town']} born?", [t["birthplace"]]


@lru_cache(maxsize=4)
def _load_rows(source: str) -> tuple[dict[str, Any], ...]:
    path = Path(source)
    rows: list[dict[str, Any]] = []
    if path.is_file():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{source}:{number}: not valid JSON ({err.msg})") from err
        return tuple(rows)
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"qa source {source!r} is not a local JSONL file, and loading it needs the `datasets` package "
            "(pip install datasets); without a source the offline synthetic QA is used"
        ) from err
    try:
        data = datasets.load_from_disk(source) if path.is_dir() else datasets.load_dataset(source, split="validation")
    except Exception as err:  # datasets raises many types; the user needs the message
        raise ValueError(f"could not load QA data {source!r}: {err}") from err
    if isinstance(data, dict):
        data = data["validation"]
    return tuple(dict(r) for r in data)


def _row_docs(row: dict[str, Any]) -> tuple[list[str], str, list[str]]:
    question = str(row["question"])
    answers = row.get("answers", row.get("answer"))
    if isinstance(answers, dict):  # SQuAD: {"text": [...], "answer_start": [...]}
        answers = answers.get("text", [])
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers:
        raise ValueError(f"QA row without answers: {question!r}")
    context = row.get("context", row.get("paragraphs"))
    if isinstance(context, dict) and "sentences" in context:  # HotpotQA
        docs = [f"{t}\n{''.join(s)}" for t, s in zip(context["title"], context["sentences"], strict=False)]
    elif isinstance(context, list):
        docs = [str(c) for c in context]
    else:
        docs = [str(context)]
    return docs, question, [str(a) for a in answers]


def qa_documents(
    rng: random.Random, num_docs: int, *, hops: int, source: str | None
) -> tuple[list[str], str, list[str], str]:
    """(documents, question, answers, source name) with about ``num_docs`` documents."""
    if source is None:
        docs, question, answers = _synthetic(rng, num_docs, hops)
        return docs, question, answers, f"synthetic-{'hotpotqa' if hops == 2 else 'squad'}-shape"
    rows = _load_rows(source)
    if not rows:
        raise ValueError(f"QA source {source!r} has no rows")
    gold_row = rows[rng.randrange(len(rows))]
    docs, question, answers = _row_docs(gold_row)
    while len(docs) < num_docs:
        other = rows[rng.randrange(len(rows))]
        if other is not gold_row:
            docs.extend(_row_docs(other)[0])
    docs = docs[: max(num_docs, len(_row_docs(gold_row)[0]))]
    rng.shuffle(docs)
    return docs, question, answers, source
