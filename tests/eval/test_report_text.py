"""Issue 42, point 4: the report's text says what the numbers mean: no ``reduction nan``, no row
twice, and each method's paired difference from the full cache with its interval."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from criticalkv.eval.report import build_report, summarise


def _line(method: str, budget: float, index: int, score: float, nll: float) -> dict[str, object]:
    return dict(
        task="mine", length=0, index=index, method=method, budget=budget, score=score, partial=score,
        nll=nll, kl=0.0, top1=1.0, kv_bytes=10, kv_bytes_full=50, meta={"line": index + 1},
    )  # fmt: skip


def _dataset_run(folder: Path) -> Path:
    """Ten samples of one own-lengths file: the full cache right on 6; snapkv and critical-snapkv
    change 4 answers' correctness (2 gained, 2 lost), so each loses nothing on average."""
    full = [1.0] * 6 + [0.0] * 4
    compressed = [0.0, 0.0] + [1.0] * 4 + [1.0, 1.0, 0.0, 0.0]
    lines = [_line("full", 1.0, i, s, 1.0) for i, s in enumerate(full)]
    for method in ("snapkv", "critical-snapkv"):
        lines += [_line(method, 0.2, i, s, 1.5) for i, s in enumerate(compressed)]
    folder.mkdir()
    (folder / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_report_text_has_no_nan_no_twice_and_paired_differences_from_full(tmp_path: Path) -> None:
    folder = _dataset_run(tmp_path / "run")
    text, _ = build_report(folder)
    assert "nan" not in text
    assert "reduction - (the base loses nothing, or gains, on these samples: nothing to reduce)" in text
    against = text[text.index("against the full cache") :].splitlines()[1:3]
    assert all("score +0.0 pts" in line and "(2 scored higher, 2 lower)" in line for line in against)
    assert all("NLL +0.500 [+0.500, +0.500]" in line and "n=10 paired samples" in line for line in against)
    with (folder / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    keys = [(r["length"], r["method"], r["budget"], r["task"]) for r in rows]
    assert len(keys) == len(set(keys)) == 3 * 2  # 3 configurations x (task, average), length 'all' only
    assert {r["length"] for r in rows} == {"all"}


def test_several_lengths_keep_their_own_rows() -> None:
    records = [_line("full", 1.0, i, 1.0, 1.0) | {"length": n} for n in (1024, 2048) for i in range(2)]
    assert {r["length"] for r in summarise(records)} == {"all", "1024", "2048"}
