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
from criticalkv.bench.record import storage_fields
from criticalkv.cache.persist import model_fingerprint
from criticalkv.defaults import DEFAULT_INTERVAL
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


def config_entry(config: BenchConfig) -> dict[str, Any]:
    """``config`` as ``run.json``'s history holds it: its fields (without the head-score file), the
    decode budget as ``decode_budget``/``decode_interval`` (``None`` and the default interval without
    one) and the storage as the records spell it (:func:`~criticalkv.bench.record.storage_fields`)."""
    entry: dict[str, Any] = {}
    for name, value in asdict(config).items():
        if name == "decode":
            decode = config.decode
            entry["decode_budget"] = None if decode is None else decode.budget
            entry["decode_interval"] = DEFAULT_INTERVAL if decode is None else decode.interval
        elif name == "storage":
            entry.update(storage_fields(config.storage))
        elif name != "head_scores":
            entry[name] = value
    return entry


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
        "config": config_entry(config),
        **provenance(),
    }
    return open_folder(out, LAYOUT, bench_identity(config, model, kvpress, fingerprint), entry)
