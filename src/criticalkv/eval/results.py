"""A sweep's results folder (a :mod:`criticalkv.runs` folder): ``results.jsonl``, one line per
(sample, method, budget), ``run.json`` (identity, then config, versions and commit of each run)
and ``skipped.jsonl`` (samples a sweep skipped, e.g. longer than the model accepts). A re-run
skips what is done.

A line is *done* when its key is there and, for samples that carry a content hash (``--dataset``
lines, ``meta.sha256``), the hash of its last line matches the sample as it is now: an edited
sample is computed again and its older lines are ignored (:func:`current_results`).
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from criticalkv.defaults import DECODE_OPTIONS, STORAGE_OPTIONS
from criticalkv.runs import FolderLayout, JsonLines, check_folder_path, git_commit, open_folder, read_json, versions
from criticalkv.runs.folder import holds_results, identity_diff

logger = logging.getLogger(__name__)

RESULTS = "results.jsonl"
RUN = "run.json"
SKIPPED = "skipped.jsonl"
#: the identity key of folders whose dataset samples are identified by content
DATASET_CHECK = "dataset_check"

LAYOUT = FolderLayout(
    config_file=RUN,
    identity_key="identity",
    history_key="runs",
    exact=False,
    mismatch="{out} holds results of a different configuration ({diff}); use another --out",
    # in the identity only when set (folders made before them resume); never resumed without them
    optional=("norm_precision", *STORAGE_OPTIONS, *DECODE_OPTIONS, "head_scores"),
    results_file="results.jsonl",
)

_TEXT = (str,)
_INT = (int,)
_NUMBER = (int, float)
#: what a result line must hold for the report, and of which type
REQUIRED: dict[str, tuple[type, ...]] = {
    "task": _TEXT,
    "length": _INT,
    "index": _INT,
    "method": _TEXT,
    "budget": _NUMBER,
    "score": _NUMBER,
    "partial": _NUMBER,
    "nll": _NUMBER,
    "kl": _NUMBER,
    "top1": _NUMBER,
    "kv_bytes": _NUMBER,
    "kv_bytes_full": _NUMBER,
}


def result_key(record: Mapping[str, Any]) -> str:
    """``task|length|index|method|budget``: what identifies a result line."""
    return "|".join(str(record[k]) for k in ("task", "length", "index", "method", "budget"))


def sample_key(record: Mapping[str, Any]) -> str:
    """``task|length|index``: the sample of a result (or skip) line."""
    return "|".join(str(record[k]) for k in ("task", "length", "index"))


def content_hash(record: Mapping[str, Any]) -> str | None:
    """The content hash of the sample a line was computed on (``None``: the benchmark has none)."""
    meta = record.get("meta")
    return meta.get("sha256") if isinstance(meta, dict) else None


def problem(record: Mapping[str, Any]) -> str | None:
    """Why ``record`` is not a result line (a missing key or a wrong type), or ``None``."""
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        return f"no {', '.join(missing)}"
    for key, types in REQUIRED.items():
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"{key} is {value!r}, not a {types[-1].__name__}"
    return None


def _log(out_dir: Path, name: str = RESULTS) -> JsonLines:
    return JsonLines(check_folder_path(out_dir) / name)


def read_results(out_dir: Path) -> list[dict[str, Any]]:
    """Every complete result line, in file order. A torn last line from an interruption is
    dropped and repaired; lines that are not results are skipped with a warning (file and line)."""
    log = _log(out_dir)
    records = []
    for number, row in log.numbered_rows():
        why = problem(row)
        if why is None:
            records.append(row)
        else:
            logger.warning("skipping line %d of %s: not a result line (%s)", number, log.path, why)
    return records


def current_results(records: list[dict[str, Any]], source: Path | str = RESULTS) -> list[dict[str, Any]]:
    """One line per key, what the report counts: the last line of each key, without the lines of
    an edited sample computed on its earlier content (another hash than the sample's last line).
    Both are logged with their count."""
    last: dict[str, dict[str, Any]] = {}
    for record in records:
        key = result_key(record)
        last.pop(key, None)  # keep the position of the last line
        last[key] = record
    doubled = len(records) - len(last)
    if doubled:
        logger.warning("%s holds %d line(s) whose key appears again later; counting the last of each", source, doubled)
    newest = {sample_key(r): content_hash(r) for r in records}
    kept = [r for r in last.values() if content_hash(r) == newest[sample_key(r)]]
    stale = len(last) - len(kept)
    if stale:
        samples = len({sample_key(r) for r in last.values()} - {sample_key(r) for r in kept})
        logger.warning(
            "%s: ignoring %d result(s) computed on an earlier version of edited sample(s) (%d sample(s) with no "
            "current result at all); rerun with those --methods and --budgets to compute them",
            source,
            stale,
            samples,
        )
    return kept


def append_result(out_dir: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (sorted keys) with a single write on an O_APPEND descriptor, then fsync."""
    _log(out_dir).append([record])


def done_index(out_dir: Path) -> dict[str, str | None]:
    """Result key -> content hash of its last line, for every result already in ``out_dir``."""
    return {result_key(r): content_hash(r) for r in read_results(out_dir)}


def iter_done(out_dir: Path) -> Iterator[str]:
    """Keys of the results already in ``out_dir``."""
    yield from done_index(out_dir)


def is_done(done: Mapping[str, str | None], key: str, sha256: str | None) -> bool:
    """Whether ``key`` is done on the sample's current content ``sha256``."""
    return key in done and done[key] == sha256


def append_skipped(out_dir: Path, record: dict[str, Any]) -> None:
    """Record a sample the sweep skipped (``task``, ``length``, ``index``, ``reason``, ``meta``)."""
    _log(out_dir, SKIPPED).append([record])


def read_skipped(out_dir: Path) -> list[dict[str, Any]]:
    """The last skip line of each sample in ``skipped.jsonl``."""
    last = {}
    for row in _log(out_dir, SKIPPED).rows():
        if all(k in row for k in ("task", "length", "index")):
            last[sample_key(row)] = row
    return list(last.values())


def _check_legacy_dataset(out_dir: Path, identity: Mapping[str, Any]) -> None:
    before = read_json(Path(out_dir) / RUN).get(LAYOUT.identity_key)
    legacy = isinstance(before, dict) and before.get("benchmark") == "dataset" and DATASET_CHECK not in before
    if identity.get(DATASET_CHECK) and legacy:
        raise ValueError(
            f"{out_dir} holds dataset results written before samples were identified by content, so an edit "
            f"of the file since then cannot be detected; run into a new --out (or delete {out_dir})"
        )


def check_run(out_dir: Path, identity: Mapping[str, Any]) -> None:
    """Refuse (``ValueError``) what :func:`open_run` would refuse, writing nothing: ``out_dir`` is a
    file, or holds results of another identity."""
    out_dir = check_folder_path(out_dir)
    _check_legacy_dataset(out_dir, identity)
    if (out_dir / RUN).exists():
        before = read_json(out_dir / RUN).get(LAYOUT.identity_key, {})
        diff = identity_diff(LAYOUT, before, identity)
        if diff and holds_results(out_dir, LAYOUT):  # a folder with no result yet is taken over (open_run)
            raise ValueError(LAYOUT.mismatch.format(out=out_dir, diff=LAYOUT.separator.join(diff)))
    for name in (RESULTS, SKIPPED):
        if (out_dir / name).is_dir():
            raise ValueError(f"{out_dir / name} is a folder, not a results file; move it out of the way")


def open_run(out_dir: Path, identity: dict[str, Any], config: dict[str, Any]) -> None:
    """Create ``run.json``, or check that an existing one was written by the same identity.

    Fields in ``identity`` decide whether results are comparable (model, mode, window, ...);
    ``config`` (tasks, methods, budgets, samples) may grow between runs. Call it holding the
    folder's writer lock (:func:`criticalkv.runs.writer_lock`).
    """
    _check_legacy_dataset(out_dir, identity)
    entry = {
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "config": config,
        "git_commit": git_commit() or "unknown",
        "versions": versions(),
    }
    open_folder(out_dir, LAYOUT, identity, entry)
