"""Loading LongBench: from a folder of its JSONL files, or through ``datasets`` when online.

Both paths feed every row through one parser (:func:`parse_row`). A folder is LongBench's
``data.zip`` unpacked: ``{dataset}.jsonl`` (LongBench) and ``{dataset}_e.jsonl`` (LongBench-E),
one JSON object per line with the fields ``input``, ``context``, ``answers``, ``length``,
``dataset``, ``language``, ``all_classes`` and ``_id``. ``datasets`` is imported only when no
folder is given; it is not a dependency of criticalkv.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HUB_ID = "THUDM/LongBench"
DATA_ZIP = "https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip"


class LongBenchUnavailable(ValueError):
    """The LongBench data cannot be read; the message says how to get it."""


def how_to_get_data(reason: str) -> str:
    return (
        f"LongBench data is not available: {reason}. The data cannot be downloaded on an offline machine; "
        f"either (1) download {DATA_ZIP} where you are online, unzip it and pass its folder of JSONL files "
        f"with --data-dir (SweepConfig.data_dir), or (2) `pip install datasets` on a machine that reaches the "
        f"Hugging Face hub, which loads {HUB_ID} when --data-dir is not given"
    )


@dataclass(frozen=True)
class Record:
    """One LongBench row. ``index`` is its 0-based position in the file (or split)."""

    dataset: str
    index: int
    input: str
    context: str
    answers: list[str]
    length: int
    language: str
    all_classes: list[str] | None
    id: str


def _strings(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"'{field}' must be a list of strings")
    return list(value)


def parse_row(row: Mapping[str, Any], dataset: str, index: int, where: str) -> Record:
    """Validate one LongBench row of ``dataset``; errors name ``where`` (file and line)."""
    try:
        missing = [k for k in ("input", "context", "answers", "length") if k not in row]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        context, question = row["context"], row["input"]
        if not isinstance(context, str) or not context.strip():
            raise ValueError("'context' must be a non-empty string")
        if not isinstance(question, str):
            raise ValueError("'input' must be a string")
        answers = _strings(row["answers"], "answers")
        if not answers:
            raise ValueError("'answers' is empty")
        length = row["length"]
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError("'length' must be a non-negative integer")
        named = str(row.get("dataset") or dataset)
        if named.removesuffix("_e") != dataset:
            raise ValueError(f"the row belongs to dataset {named!r}, not {dataset!r}")
        classes = row.get("all_classes")
        all_classes = None if classes is None else _strings(classes, "all_classes")
        if dataset in ("trec", "lsht") and not all_classes:
            raise ValueError(f"{dataset} rows need 'all_classes' (its classification metric uses them)")
        return Record(
            dataset=dataset,
            index=index,
            input=question,
            context=context,
            answers=answers,
            length=length,
            language=str(row.get("language") or ""),
            all_classes=all_classes,
            id=str(row.get("_id") or ""),
        )
    except ValueError as err:
        raise ValueError(f"{where}: not a LongBench row ({err})") from err


def file_name(dataset: str, longbench_e: bool = False) -> str:
    return f"{dataset}{'_e' if longbench_e else ''}.jsonl"


def local_path(data_dir: str | Path, dataset: str, longbench_e: bool = False) -> Path:
    """``data_dir/{dataset}[_e].jsonl``, or the same under ``data_dir/data/`` (the zip's folder)."""
    root = Path(data_dir)
    name = file_name(dataset, longbench_e)
    for path in (root / name, root / "data" / name):
        if path.is_file():
            return path
    raise LongBenchUnavailable(how_to_get_data(f"{root / name} does not exist"))


def check_local(data_dir: str | Path, datasets: Iterable[str], longbench_e: bool = False) -> None:
    """Raise (naming every missing file) unless ``data_dir`` has all the datasets' files."""
    root = Path(data_dir)
    if not root.is_dir():
        raise LongBenchUnavailable(how_to_get_data(f"--data-dir {root} is not a folder"))
    names = list(datasets)
    missing = []
    for name in names:
        try:
            local_path(root, name, longbench_e)
        except LongBenchUnavailable:
            missing.append(file_name(name, longbench_e))
    if missing:
        raise LongBenchUnavailable(how_to_get_data(f"{root} lacks {', '.join(missing)}"))


def read_local(data_dir: str | Path, dataset: str, longbench_e: bool = False, limit: int | None = None) -> list[Record]:
    """The first ``limit`` rows (all if ``None``) of a dataset's JSONL file."""
    path = local_path(data_dir, dataset, longbench_e)
    records: list[Record] = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err})") from err
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            records.append(parse_row(row, dataset, len(records), f"{path}:{number}"))
    if not records:
        raise ValueError(f"{path} has no rows")
    logger.info("read %d %s rows from %s", len(records), dataset, path)
    return records


def _datasets_module() -> Any:
    try:
        return importlib.import_module("datasets")
    except ImportError as err:
        raise LongBenchUnavailable(how_to_get_data("no --data-dir was given and `datasets` is not installed")) from err


def check_hub() -> None:
    """Raise unless ``datasets`` can be imported (whether the hub answers shows only on loading)."""
    _datasets_module()


def read_hub(dataset: str, longbench_e: bool = False, limit: int | None = None) -> list[Record]:
    """The first ``limit`` rows of ``THUDM/LongBench``'s ``{dataset}[_e]`` test split via ``datasets``."""
    module = _datasets_module()
    name = dataset + ("_e" if longbench_e else "")
    major = int(str(getattr(module, "__version__", "0")).split(".")[0] or 0)
    kwargs: dict[str, Any] = {"trust_remote_code": True} if major < 4 else {}  # LongBench ships a loading script
    try:
        rows = module.load_dataset(HUB_ID, name, split="test", **kwargs)
    except Exception as err:  # network, hub, or script errors: all end in the same advice
        raise LongBenchUnavailable(
            how_to_get_data(f"datasets.load_dataset({HUB_ID!r}, {name!r}) failed: {err}")
        ) from err
    records: list[Record] = []
    for row in rows:
        if limit is not None and len(records) >= limit:
            break
        records.append(parse_row(row, dataset, len(records), f"{HUB_ID}/{name} row {len(records)}"))
    if not records:
        raise ValueError(f"{HUB_ID}/{name} has no rows")
    return records


def load_records(
    dataset: str, data_dir: str | Path | None = None, longbench_e: bool = False, limit: int | None = None
) -> list[Record]:
    """Rows of a dataset: from ``data_dir`` if given, else from the hub through ``datasets``."""
    if data_dir is not None:
        return read_local(data_dir, dataset, longbench_e, limit)
    return read_hub(dataset, longbench_e, limit)
