"""LongBench rows -> :class:`~criticalkv.eval.sample.Sample` objects for the sweep runner.

* The prompt is the dataset's template (:mod:`~criticalkv.eval.longbench.tasks`); the sample's
  ``context`` is the template head plus the (truncated) context, its ``question`` the rest of
  the template (``verbatim``: the two are joined with nothing in between and no answer prefix).
* ``max_length`` -- the sweep's ``--lengths`` value -- is LongBench's ``max_length``: the prompt
  (without the chat template) is middle-truncated to at most that many tokens (LongBench uses
  the model's window minus 500, e.g. 3500 for 4K models, 31500 for 32K models).
* The chat template is applied except on ``trec``, ``triviaqa``, ``samsum``, ``lsht``, ``lcc`` and
  ``repobench-p`` (``chat=False``), as LongBench's ``pred.py`` does; the sweep's ``--no-chat``
  turns it off everywhere.
* ``meta`` keeps ``dataset``, ``language``, ``length`` (LongBench's, in words or characters),
  ``bucket`` (LongBench-E), ``all_classes``, ``_id``, ``first_line`` and the truncation.
* The teacher-forced text of the fidelity metrics (``gold``) is the first answer, cut to the
  dataset's generation length, with a leading space where a raw prompt ends in ``":"``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from criticalkv.eval.longbench.buckets import bucket_of
from criticalkv.eval.longbench.loader import Record, load_records
from criticalkv.eval.longbench.tasks import FIRST_LINE, MAX_NEW_TOKENS, METRIC, NO_CHAT, split_template
from criticalkv.eval.longbench.truncation import middle_truncate
from criticalkv.eval.sample import Sample


def _gold(tokenizer: Any, answer: str, max_new: int, space: bool) -> str:
    text = (" " if space else "") + answer
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return text if len(ids) <= max_new else str(tokenizer.decode(ids[:max_new], skip_special_tokens=True))


def make_sample(record: Record, tokenizer: Any, max_length: int) -> Sample:
    """The sample of one LongBench row with its prompt middle-truncated to ``max_length`` tokens."""
    dataset = record.dataset
    head, tail = split_template(dataset, record.input)
    cut = middle_truncate(tokenizer, [head, record.context, tail], max_length)
    head_kept, context_kept, tail_kept = cut.parts
    raw = dataset in NO_CHAT
    max_new = MAX_NEW_TOKENS[dataset]
    meta = {
        "dataset": dataset,
        "language": record.language,
        "length": record.length,
        "bucket": bucket_of(record.length),
        "all_classes": record.all_classes,
        "_id": record.id,
        "first_line": dataset in FIRST_LINE,
        "max_length": max_length,
        "prompt_tokens_before": cut.tokens,
        "truncated_tokens": cut.removed,
    }
    return Sample(
        task=dataset,
        index=record.index,
        context=head_kept + context_kept,
        question=tail_kept,
        answers=list(record.answers),
        metric=METRIC[dataset],
        max_new_tokens=max_new,
        meta=meta,
        verbatim=True,
        chat=not raw,
        gold=_gold(tokenizer, record.answers[0], max_new, raw and tail_kept.endswith(":")),
    )


def iter_samples(
    tasks: Sequence[str],
    tokenizer: Any,
    lengths: Sequence[int],
    samples: int,
    data_dir: str | Path | None = None,
    longbench_e: bool = False,
) -> Iterator[tuple[int, Sample]]:
    """``(max_length, sample)`` for the first ``samples`` rows of each dataset, sample-major (an
    interrupted sweep has covered every dataset and length with fewer samples)."""
    records = {task: load_records(task, data_dir, longbench_e, limit=samples) for task in tasks}
    for index in range(samples):
        for length in lengths:
            for task in tasks:
                if index < len(records[task]):
                    yield length, make_sample(records[task][index], tokenizer, length)


def prepare_sweep(tasks: Sequence[str], data_dir: str | Path | None, longbench_e: bool) -> tuple[list[str], str | None]:
    """Check a LongBench sweep before it starts: resolved dataset names (groups expanded) and
    the absolute ``data_dir``. Raises if the data or jieba (Chinese metrics) is missing."""
    from criticalkv.eval.longbench.loader import check_hub, check_local
    from criticalkv.eval.longbench.segment import NEEDS_JIEBA, require_jieba
    from criticalkv.eval.longbench.tasks import resolve_tasks

    names = resolve_tasks(tasks, longbench_e)
    if NEEDS_JIEBA.intersection(names):
        require_jieba()
    if data_dir is None:
        check_hub()
        return names, None
    check_local(data_dir, names, longbench_e)
    return names, str(Path(data_dir).resolve())
