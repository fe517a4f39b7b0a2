"""benchmarks/quantized_storage_report.py on synthetic folders: the NLL increase against the float32
full cache, the paired quantized-minus-float32 difference, bits per element, and the HF series."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "quantized_storage_report.py"
    spec = importlib.util.spec_from_file_location("quantized_storage_report_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _load()
SAMPLES = [("niah_single_1", i) for i in range(3)] + [("qa_1", i) for i in range(3)]


def _record(task: str, index: int, method: str, budget: float, nll: float, kv_bytes: int) -> dict[str, Any]:
    return {
        "task": task, "length": 1024, "index": index, "method": method, "budget": budget, "score": 1.0,
        "nll": nll, "kl": 0.1, "top1": 1.0, "kv_bytes": kv_bytes, "kv_bytes_full": 3200,
    }  # fmt: skip


def _folder(path: Path, records: list[dict[str, Any]]) -> Path:
    path.mkdir()
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_rows_pair_each_sample_with_its_float32_row(tmp_path: Path) -> None:
    base = {s: 1.0 + 0.1 * n for n, s in enumerate(SAMPLES)}
    plain = [_record(t, i, "full", 1.0, base[(t, i)], 3200) for t, i in SAMPLES]
    plain += [_record(t, i, "snapkv", 0.5, base[(t, i)] + 1.0, 1600) for t, i in SAMPLES]
    eight = [_record(t, i, m, b, nll + 0.01, k // 4 + 50) for r in plain for t, i, m, b, nll, k in [_key(r)]]
    four = [_record(t, i, m, b, nll + 0.2, k // 8 + 50) for r in plain for t, i, m, b, nll, k in [_key(r)]]
    folders = [_folder(tmp_path / n, rs) for n, rs in (("b16", plain), ("b8", eight), ("b4", four))]
    rows = {(r["kv_bits"], r["method"]): r for r in report.ours(folders)}
    assert rows[(16, "snapkv")]["nll_increase"] == pytest.approx(1.0)
    assert rows[(8, "snapkv")]["nll_increase"] == pytest.approx(1.01)
    assert rows[(8, "snapkv")]["nll_vs_float32"] == pytest.approx(0.01)  # every pair differs by exactly 0.01
    assert rows[(8, "snapkv")]["nll_vs_float32_low"] == pytest.approx(0.01)
    assert rows[(4, "full")]["nll_vs_float32"] == pytest.approx(0.2)
    assert rows[(8, "full")]["bits_per_element"] == pytest.approx(32 * 850 / 3200)
    assert "nll_vs_float32" not in rows[(16, "full")]
    hf = [
        {"task": t, "length": 1024, "index": i, "kv_bits": b, "backend": "hqq", "nll": base[(t, i)] + d, "kl": 0.0,
         "top1": 1.0, "kv_bytes": 1000, "kv_bytes_full": 3200, "bits_per_element": 10.0, "score": 0.0}
        for t, i in SAMPLES for b, d in ((32, 0.0), (8, 0.003), (4, 0.05))
    ]  # fmt: skip
    (tmp_path / "hf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hf))
    series = {r["kv_bits"]: r for r in report.hf_rows(tmp_path / "hf.jsonl", folders[0])}
    assert set(series) == {8, 4} and series[8]["series"] == "transformers-hqq" and series[8]["n"] == 6
    assert series[8]["nll_increase"] == pytest.approx(0.003) and series[4]["nll_vs_float32"] == pytest.approx(0.05)
    assert series[4]["kv_ratio"] == pytest.approx(1000 / 3200)
    report.chart([*rows.values(), *series.values()], tmp_path)
    assert (tmp_path / "pareto.png").stat().st_size > 0


def _key(r: dict[str, Any]) -> tuple[str, int, str, float, float, int]:
    return r["task"], r["index"], r["method"], r["budget"], r["nll"], r["kv_bytes"]
