"""LongBench's 21 datasets: prompt templates, generation lengths, metrics and chat handling.

LongBench (Bai et al. 2023, arXiv 2308.14508). The templates (``config/dataset2prompt.json``),
generation lengths (``config/dataset2maxlen.json``), the datasets run without a chat template
(``pred.py``), the metric of each dataset and the datasets scored on their first line
(``eval.py``) are LongBench's, verbatim (including the template typo "asconcisely"); they are
JSON files in ``criticalkv/data/longbench`` (the first two under LongBench's own file names).

Every template has exactly one ``{context}`` and, where it has one, ``{input}`` after it, so the
split that question-agnostic compression needs is the template's own: the *context part* is the
template up to ``{context}`` plus the context, the *question part* everything after the context
with ``{input}`` filled in. Datasets without ``{input}`` (``gov_report``, ``multi_news``,
``vcsum``, ``passage_count``, ``lcc``) have only the closing instruction as question part; for
``repobench-p`` the question part is the in-file code (``input``), the context the cross-file code.
"""

from __future__ import annotations

from collections.abc import Iterable

from criticalkv.datafiles import read_json

_NAMES = read_json("longbench/datasets.json")

#: the 21 LongBench (v1) datasets, in LongBench's order
DATASETS: tuple[str, ...] = tuple(_NAMES["datasets"])
#: the 13 datasets LongBench-E has (files ``{name}_e.jsonl``)
E_DATASETS: tuple[str, ...] = tuple(_NAMES["e_datasets"])
#: the five Chinese datasets
ZH_DATASETS: tuple[str, ...] = tuple(_NAMES["zh_datasets"])
#: the 16 English and code datasets, the set the CriticalKV and AdaKV papers report
EN_DATASETS: tuple[str, ...] = tuple(d for d in DATASETS if d not in ZH_DATASETS)
#: task groups ``--tasks`` accepts besides dataset names
GROUPS = ("all", "en", "zh")

#: datasets LongBench prompts without the chat template ("chat models are better off without")
NO_CHAT: frozenset[str] = frozenset(_NAMES["no_chat"])
#: few-shot datasets whose prediction is scored on its first line only
FIRST_LINE: frozenset[str] = frozenset(_NAMES["first_line"])

#: maximum new tokens per dataset (``dataset2maxlen.json``)
MAX_NEW_TOKENS: dict[str, int] = read_json("longbench/dataset2maxlen.json")
#: the metric of each dataset (``eval.py``'s ``dataset2metric``), by the names of
#: :mod:`criticalkv.eval.longbench.scoring`
METRIC: dict[str, str] = read_json("longbench/dataset2metric.json")
#: the prompt template of each dataset (``dataset2prompt.json``)
PROMPTS: dict[str, str] = read_json("longbench/dataset2prompt.json")


def split_template(dataset: str, question_input: str) -> tuple[str, str]:
    """(head, tail) of a dataset's prompt around ``{context}``, with ``{input}`` filled into the tail."""
    if dataset not in PROMPTS:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; choose from: {', '.join(DATASETS)}")
    head, tail = PROMPTS[dataset].split("{context}")
    return head, tail.replace("{input}", question_input)


def resolve_tasks(spec: str | Iterable[str], longbench_e: bool = False) -> list[str]:
    """Dataset names from ``--tasks``: names and the groups ``all``, ``en`` (the 16 English and
    code datasets) and ``zh``, comma-separated or as a list; duplicates dropped, order kept.

    With ``longbench_e`` only LongBench-E's 13 datasets are allowed (``all`` and ``en`` mean those).
    """
    parts = [p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec) if p.strip()]
    if not parts:
        raise ValueError("no LongBench tasks given")
    allowed = E_DATASETS if longbench_e else DATASETS
    out: list[str] = []
    for part in parts:
        if part == "all":
            names: Iterable[str] = allowed
        elif part == "en":
            names = [d for d in EN_DATASETS if d in allowed]
        elif part == "zh":
            names = [d for d in ZH_DATASETS if d in allowed]
            if not names:
                raise ValueError("LongBench-E has no Chinese datasets; drop 'zh' or --longbench-e")
        else:
            name = part.removesuffix("_e") if longbench_e else part
            if name not in allowed:
                which = "LongBench-E" if longbench_e else "LongBench"
                raise ValueError(
                    f"unknown {which} task {part!r}; choose from: {', '.join(allowed)} (or {', '.join(GROUPS)})"
                )
            names = [name]
        out += [n for n in names if n not in out]
    return out
