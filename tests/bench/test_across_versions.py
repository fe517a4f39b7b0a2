"""benchmarks/across_versions.py: its ``records`` job passes only when every matched record agrees,
and its ``bench`` job pools folders per configuration and flags differing bytes or tokens."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "across_versions_under_test", ROOT / "benchmarks" / "across_versions.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


across = _load()


def _write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _row(index: int, score: float, nll: float | None = 1.0) -> dict:
    row = {
        "task": "t",
        "index": index,
        "method": "snapkv",
        "budget": 0.2,
        "prediction": "p",
        "score": score,
        "kv_bytes": 10,
    }
    if nll is not None:
        row["nll"] = nll
    return row


def test_records_agree_and_report_the_nll_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _write(tmp_path / "old.jsonl", [_row(0, 1.0), _row(1, 0.0)])
    new = _write(tmp_path / "new.jsonl", [_row(1, 0.0, nll=1.25), _row(0, 1.0)])
    assert across.main(["records", str(old), str(new)]) == 0
    assert "2 records matched" in capsys.readouterr().out


def test_records_fail_on_a_changed_field_or_an_unmatched_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path / "old.jsonl", [_row(0, 1.0), _row(1, 0.0)])
    changed = _write(tmp_path / "changed.jsonl", [_row(0, 1.0), _row(1, 1.0)])
    assert across.main(["records", str(old), str(changed)]) == 1
    assert "'score': 1" in capsys.readouterr().out
    stranger = _write(tmp_path / "stranger.jsonl", [_row(7, 1.0)])
    assert across.main(["records", str(old), str(stranger)]) == 1
    assert "not in OLD" in capsys.readouterr().out


def test_records_without_nll_compare_the_named_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"sample": 0, "method": "full", "budget": 1.0, "answer": "a", "kv_bytes": 3}]
    old, new = _write(tmp_path / "a.jsonl", rows), _write(tmp_path / "b.jsonl", rows)
    argv = ["records", str(old), str(new), "--key", "sample,method,budget", "--fields", "answer,kv_bytes"]
    assert across.main(argv) == 0
    assert "max |nll change| 0" in capsys.readouterr().out


def _bench_folder(path: Path, decode_ms: float, tokens: list[int], kv_bytes: int = 100) -> Path:
    record = {"method": "snapkv", "kv_bits": None, "compress_s": 0.5, "decode_ms_per_token": decode_ms, "ttft_s": 2.0}
    _write(path / "records.jsonl", [{**record, "greedy_tokens": tokens, "kv_bytes": kv_bytes}])
    return path


def test_bench_pools_per_configuration_and_flags_differences(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = [_bench_folder(tmp_path / "b1", 90.0, [1, 2]), _bench_folder(tmp_path / "b2", 110.0, [1, 2])]
    after = [_bench_folder(tmp_path / "a1", 80.0, [1, 2])]
    assert across.main(["bench", "--before", *map(str, before), "--after", *map(str, after)]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith("| snapkv"))
    assert "2 -> 1" in line and "90.000 / 100.000 -> 80.000 / 80.000" in line and "DIFFER" not in line
    odd = [_bench_folder(tmp_path / "a2", 80.0, [1, 3], kv_bytes=99)]
    across.main(["bench", "--before", *map(str, before), "--after", *map(str, odd)])
    assert "KV BYTES DIFFER TOKENS DIFFER" in capsys.readouterr().out
