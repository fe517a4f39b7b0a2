"""Bring your own data: a JSONL file of ``{"context", "question", "answers", "metric"?}`` lines.

Each sample carries ``meta.sha256``, a hash of its line's content (the parsed JSON object, so
whitespace does not count): results are tied to the content, not to the file's path.

Optional fields: ``metric`` (``string_match_part`` by default, or ``string_match_all``),
``task`` (a name to group results by; the file's stem by default), ``answer_prefix`` and
``max_new_tokens`` (32 by default). Malformed lines are reported with their line number and
skipped; the rest run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from criticalkv.eval.sample import Sample
from criticalkv.eval.tasks.scoring import METRICS

logger = logging.getLogger(__name__)


def line_hash(row: dict[str, object]) -> str:
    """The first 16 hex digits of the SHA-256 of ``row`` as canonical JSON (sorted keys)."""
    text = json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


#: the longest line a dataset file may have, in bytes: 64 MiB, about 16 million tokens of English,
#: far beyond any model's context (a longer line is refused before it is read into memory)
MAX_LINE_BYTES = 64 * 1024 * 1024


def _read_lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 file (a byte-order mark dropped), each read at most :data:`MAX_LINE_BYTES`
    at a time, so a huge line is refused without holding it."""
    if path.is_dir():
        raise ValueError(f"dataset {path} is a folder; pass a JSONL file")
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    with path.open("rb") as handle:
        for number in itertools.count(1):
            raw = handle.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(
                    f"line {number} of dataset file {path} is over {MAX_LINE_BYTES:,} bytes, longer than any "
                    "model's context; split it into samples of at most that size"
                )
            yield _decode(raw, path, number)


def _decode(raw: bytes, path: Path, number: int) -> str:
    try:
        text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"dataset file {path} is not UTF-8 text ({error}); save it as UTF-8") from None
    return text.rstrip("\r\n")


def load_dataset_file(path: str | Path) -> list[Sample]:
    """Samples of a JSONL file; malformed lines are logged (with line numbers) and skipped."""
    return read_dataset_file(path)[0]


def unusable_lines(path: str | Path) -> list[tuple[int, str]]:
    """``(line number, why)`` of every non-blank line of ``path`` that is not a usable sample."""
    return read_dataset_file(path)[1]


def read_dataset_file(path: str | Path) -> tuple[list[Sample], list[tuple[int, str]]]:
    """The samples of a JSONL file and ``(line, why)`` of the lines skipped (logged with their numbers)."""
    path = Path(path)
    samples: list[Sample] = []
    problems: list[tuple[int, str]] = []
    for number, line in enumerate(_read_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
            missing = [k for k in ("context", "question", "answers") if k not in row]
            if missing:
                raise ValueError(f"missing field(s) {', '.join(missing)}")
            answers = row["answers"]
            if isinstance(answers, str):
                answers = [answers]
            if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
                raise ValueError("'answers' must be a non-empty list of strings")
            if any(not a.strip() for a in answers):
                raise ValueError("an answer is empty or only whitespace (it would match every prediction)")
            if not str(row["context"]).strip() or not str(row["question"]).strip():
                raise ValueError("empty context or question")
            metric = row.get("metric", "string_match_part")
            if metric not in METRICS:
                raise ValueError(f"unknown metric {metric!r} (choose from {', '.join(METRICS)})")
            samples.append(
                Sample(
                    task=str(row.get("task", path.stem)),
                    index=number,
                    context=str(row["context"]),
                    question=str(row["question"]),
                    answers=answers,
                    metric=metric,
                    max_new_tokens=int(row.get("max_new_tokens", 32)),
                    answer_prefix=str(row.get("answer_prefix", "")),
                    meta={"line": number, "sha256": line_hash(row)},
                )
            )
        except (json.JSONDecodeError, ValueError, TypeError) as err:
            problems.append((number, str(err)))
    for number, why in problems:
        logger.warning("skipping malformed line %s:%d: %s", path, number, why)
    if not samples:
        first = f" ({path}:{problems[0][0]}: {problems[0][1]})" if problems else ""
        raise ValueError(f"no usable samples in {path}{first}")
    return samples, problems


def first_per_task(samples: list[Sample], per_task: int | None) -> tuple[list[Sample], dict[str, tuple[int, int]]]:
    """The first ``per_task`` samples of each task (``--samples`` means per task, as for RULER;
    ``None``: all of them).

    Returns them sample-major (the first of every task, then the second, ...), so an interrupted
    sweep has covered every task, and ``{task: (used, available)}`` in the file's task order.
    """
    if per_task is not None and (isinstance(per_task, bool) or not isinstance(per_task, int) or per_task < 1):
        raise ValueError(f"samples per task must be a positive integer, not {per_task!r}")
    by_task: dict[str, list[Sample]] = {}
    for sample in samples:
        by_task.setdefault(sample.task, []).append(sample)
    if per_task is None:
        per_task = max((len(rows) for rows in by_task.values()), default=0)
    chosen = {task: rows[:per_task] for task, rows in by_task.items()}
    ordered = [rows[i] for i in range(per_task) for rows in chosen.values() if i < len(rows)]
    return ordered, {task: (len(chosen[task]), len(rows)) for task, rows in by_task.items()}


def describe_usage(path: str | Path, usage: dict[str, tuple[int, int]]) -> str:
    """One line: how many lines of each task of ``path`` a sweep uses."""
    parts = ", ".join(f"{task} {used} of {available}" for task, (used, available) in usage.items())
    return f"{path}: lines used per task (--samples is per task): {parts}"
