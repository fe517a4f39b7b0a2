"""Results on disk: ``results.jsonl`` (one line per (sample, method, budget), appended atomically)
and ``run.json`` (config, versions, commit). A re-run skips what is done."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RESULTS = "results.jsonl"
RUN = "run.json"


def result_key(record: dict[str, Any]) -> str:
    return "|".join(str(record[k]) for k in ("task", "length", "index", "method", "budget"))


def read_results(out_dir: Path) -> list[dict[str, Any]]:
    """All complete result lines (a torn last line from an interruption is dropped and repaired)."""
    path = out_dir / RESULTS
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        logger.warning("dropping an incomplete last line of %s (interrupted write)", path)
        with path.open("r+b") as fh:
            fh.truncate(cut)
        data = data[:cut]
    records = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s:%d is not valid JSON; ignored", path, number)
    return records


def append_result(out_dir: Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write on an O_APPEND descriptor, then fsync."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
    fd = os.open(out_dir / RESULTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def git_commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    import torch
    import transformers

    import criticalkv

    return {"criticalkv": criticalkv.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def open_run(out_dir: Path, identity: dict[str, Any], config: dict[str, Any]) -> None:
    """Create ``run.json``, or check that an existing one was written by the same identity.

    Fields in ``identity`` decide whether results are comparable (model, mode, window, ...);
    ``config`` (tasks, methods, budgets, samples) may grow between runs.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RUN
    if path.exists():
        old = json.loads(path.read_text())
        before = old.get("identity", {})
        diff = {k: (before.get(k), v) for k, v in identity.items() if before.get(k) != v}
        if diff:
            shown = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
            raise ValueError(f"{out_dir} holds results of a different configuration ({shown}); use another --out")
        history = old.get("runs", [])
    else:
        history = []
    history.append(
        {
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "config": config,
            "git_commit": git_commit(),
            "versions": versions(),
        }
    )
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"identity": identity, "runs": history}, indent=2))
    os.replace(tmp, path)


def iter_done(out_dir: Path) -> Iterator[str]:
    for record in read_results(out_dir):
        yield result_key(record)
