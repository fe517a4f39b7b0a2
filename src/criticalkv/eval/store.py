"""A sweep's results folder (a :mod:`criticalkv.runs` folder): ``results.jsonl``, one line per
(sample, method, budget), and ``run.json`` (identity, then config, versions and commit of each
run). A re-run skips what is done."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from criticalkv.runs import FolderLayout, JsonLines, git_commit, open_folder, versions

RESULTS = "results.jsonl"
RUN = "run.json"

LAYOUT = FolderLayout(
    config_file=RUN,
    identity_key="identity",
    history_key="runs",
    exact=False,
    mismatch="{out} holds results of a different configuration ({diff}); use another --out",
)


def result_key(record: dict[str, Any]) -> str:
    """``task|length|index|method|budget``: what identifies a result line."""
    return "|".join(str(record[k]) for k in ("task", "length", "index", "method", "budget"))


def _log(out_dir: Path) -> JsonLines:
    return JsonLines(Path(out_dir) / RESULTS)


def read_results(out_dir: Path) -> list[dict[str, Any]]:
    """All complete result lines (a torn last line from an interruption is dropped and repaired)."""
    return _log(out_dir).rows()


def append_result(out_dir: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (sorted keys) with a single write on an O_APPEND descriptor, then fsync."""
    _log(out_dir).append([record])


def open_run(out_dir: Path, identity: dict[str, Any], config: dict[str, Any]) -> None:
    """Create ``run.json``, or check that an existing one was written by the same identity.

    Fields in ``identity`` decide whether results are comparable (model, mode, window, ...);
    ``config`` (tasks, methods, budgets, samples) may grow between runs.
    """
    entry = {
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "config": config,
        "git_commit": git_commit() or "unknown",
        "versions": versions(),
    }
    open_folder(out_dir, LAYOUT, identity, entry)


def iter_done(out_dir: Path) -> Iterator[str]:
    """Keys of the results already in ``out_dir``."""
    for record in read_results(out_dir):
        yield result_key(record)
