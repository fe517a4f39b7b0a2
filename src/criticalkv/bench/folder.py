"""A bench ``--out`` folder's ``run.json``: what its records were measured on, checked on resume.

``records.jsonl`` is keyed by (implementation, method, context, budget, batch, decode and storage
settings); what is outside that key -- the model, its dtype and device, the window, the decode
length, best-of-N, the library versions -- is this folder's identity. A run resuming into a folder
of another identity is refused with the difference named, so one table never mixes two setups.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
from dataclasses import asdict
from pathlib import Path
from typing import Any

from criticalkv.bench.config import BenchConfig
from criticalkv.cache.persist import model_fingerprint
from criticalkv.runs import FolderLayout, open_folder, provenance, versions
from criticalkv.runtime.forward import input_device

RUN = "run.json"
LAYOUT = FolderLayout(
    config_file=RUN,
    identity_key="identity",
    history_key="runs",
    exact=False,
    mismatch="{out} holds bench records of a different setup ({diff}); use another --out",
    trailing_newline=True,
    optional=("norm_precision", "head_scores"),
    results_file="records.jsonl",
)


def _kvpress_version() -> str | None:
    try:
        return importlib.metadata.version("kvpress")
    except importlib.metadata.PackageNotFoundError:
        return None


def bench_identity(config: BenchConfig, model: Any, kvpress: bool, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """What must match for records to be comparable in one folder (``kvpress``: compared at all;
    ``fingerprint``: the model's :func:`~criticalkv.cache.persist.fingerprint.model_fingerprint`)."""
    identity: dict[str, Any] = {
        "model": fingerprint["hash"],
        "dtype": fingerprint["dtype"],
        "device": str(input_device(model)),
        "window": config.window,
        "decode_tokens": config.decode_tokens,
        "repeats": config.repeats,
        **versions(),
        "kvpress": _kvpress_version() if kvpress else None,
    }
    if config.norm_precision is not None:
        identity["norm_precision"] = config.norm_precision
    if config.head_scores is not None:
        identity["head_scores"] = str(config.head_scores)
    return identity


def open_bench_folder(out: Path, config: BenchConfig, model: Any, kvpress: bool) -> dict[str, Any]:
    """Create ``out/run.json`` or check it against this run's identity; append this run to its history.

    Raises
    ------
    ValueError
        If ``out`` holds records of another setup (the message names each difference).
    """
    fingerprint = model_fingerprint(model)  # hashes samples of every parameter: once per run
    entry = {
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "model_name": fingerprint["name"],
        "config": {key: value for key, value in asdict(config).items() if key != "head_scores"},
        **provenance(),
    }
    return open_folder(out, LAYOUT, bench_identity(config, model, kvpress, fingerprint), entry)
