"""A sweep's hold on its results folder: checked before anything is written, one writer at a
time, and no trace left by a run that fails before its first result."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from criticalkv.eval.results import (
    LAYOUT,
    RESULTS,
    RUN,
    SKIPPED,
    append_skipped,
    check_run,
    open_run,
    read_skipped,
    sample_key,
)
from criticalkv.runs import DEFAULT_WAIT, writer_lock

if TYPE_CHECKING:
    from criticalkv.eval.sweep.config import SweepConfig

logger = logging.getLogger(__name__)


def _undo_new_run(out: Path) -> None:
    """Remove what a run that wrote no result made in a folder new to it (so the corrected command
    starts clean). The empty lock file stays: removing it could let a waiting writer and a new one
    hold two different locks; it blocks nothing."""
    if (out / RESULTS).is_file() and (out / RESULTS).stat().st_size > 0:
        return
    for name in (RUN, RESULTS, SKIPPED, RUN + ".tmp"):
        (out / name).unlink(missing_ok=True)
    logger.info("removed the run.json of %s: the run stopped before its first result", out)


@contextmanager
def sweep_folder(
    out: Path, identity: dict[str, Any], config: dict[str, Any], wait: float = DEFAULT_WAIT
) -> Iterator[Path]:
    """Check ``out`` against ``identity`` (writing nothing), take its writer lock (waiting up to
    ``wait`` seconds for another writer), record the run in ``run.json``, and run the block.

    If ``out`` had no ``run.json`` before and the block fails before writing a result, the
    ``run.json`` this run made is removed again (only an empty ``writer.lock`` stays).

    Raises
    ------
    ValueError
        If ``out`` is a file, holds results of another identity, or another process is writing
        to it (:class:`~criticalkv.runs.FolderBusy`).
    """
    out = Path(out)
    check_run(out, identity)
    with writer_lock(out, wait):
        fresh = not (out / RUN).is_file()
        try:
            open_run(out, identity, config)
            yield out
        except BaseException:
            if fresh:
                _undo_new_run(out)
            raise


__all__ = ["LAYOUT", "sweep_folder"]


def record_unusable(out: Path, config: SweepConfig) -> None:
    """List the benchmark's unusable inputs (a dataset's malformed lines) in ``skipped.jsonl``, once."""
    known = {sample_key(s) for s in read_skipped(out)}
    for skip in config.bench.unusable(config.options):
        if sample_key(skip) not in known:
            append_skipped(out, skip)
