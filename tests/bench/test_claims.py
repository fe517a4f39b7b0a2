"""benchmarks/claims.py on tiny synthetic result folders whose claims have known answers."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from criticalkv.eval.report import by_config, paired_difference


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "claims.py"
    spec = importlib.util.spec_from_file_location("claims_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


claims = _load()


def _record(method: str, budget: float, task: str, index: int, score: float, nll: float) -> dict[str, Any]:
    return {
        "task": task, "length": 1024, "index": index, "method": method, "budget": budget, "score": score,
        "partial": score, "nll": nll, "kl": 0.0, "top1": 1.0, "kv_bytes": 1, "kv_bytes_full": 4,
        "metric": "string_match_all", "answers": ["x"], "prediction": "x",
    }  # fmt: skip


def _ruler(folder: Path, critical_zero_below: int, samples: int = 12) -> None:
    """Full scores 1; the base misses the first half of each task; the Critical variant the first
    ``critical_zero_below`` samples: base loss 0.5, critical loss critical_zero_below / samples."""
    folder.mkdir()
    lines = []
    for task in ("a", "b"):
        for i in range(samples):
            lines.append(_record("full", 1.0, task, i, 1.0, 1.0))
            lines.append(_record("snapkv", 0.2, task, i, float(i >= samples // 2), 2.0))
            lines.append(_record("critical-snapkv", 0.2, task, i, float(i >= critical_zero_below), 1.5))
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    config = {
        "out": str(folder), "benchmark": "ruler", "tasks": ["a", "b"], "lengths": [1024],
        "methods": ["full", "snapkv", "critical-snapkv"], "budgets": [0.2], "samples": samples,
        "mode": "question-aware", "max_new_tokens": 32, "model": "default",
    }  # fmt: skip
    (folder / "run.json").write_text(json.dumps({"identity": {}, "runs": [{"config": config}]}))


def _perturbation(folder: Path, samples: int) -> None:
    """Per head, the Critical variant's perturbation is lower in 95 of 100 heads on every sample;
    its final hidden-state drift is half the base's."""
    folder.mkdir()
    base = np.ones((10, 10))
    variant = np.full((10, 10), 0.5)
    variant.flat[:5] = 2.0
    rows = []
    for s in range(samples):
        for method, heads, hidden in (("snapkv", base, 2.0), ("critical-snapkv", variant, 1.0)):
            row = {"sample": s, "method": method, "budget": 0.2, "hidden_l1": hidden}
            row["base"] = "snapkv" if method.startswith("critical") else None
            row["perturbation_decode"] = row["perturbation_window"] = heads.tolist()
            rows.append(row)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.json").write_text(json.dumps({"spec": {}, "commands": ["criticalkv perturbation --out P"]}))


def _performance(folder: Path) -> None:
    folder.mkdir()
    rows = [
        {"method": "snapkv", "ttft_s": 10.0, "compress_s": 0.1, "decode_ms_per_token": 50.0},
        {"method": "critical-snapkv", "ttft_s": 10.3, "compress_s": 0.3, "decode_ms_per_token": 51.0},
    ]
    common = {"impl": "criticalkv", "batch_size": 1, "context_tokens": 4096, "budget": 0.2}
    (folder / "records.jsonl").write_text("".join(json.dumps({**common, **r}) + "\n" for r in rows))


def test_loss_reduction_and_gains_from_a_ruler_folder(tmp_path: Path) -> None:
    _ruler(tmp_path / "r", critical_zero_below=2)
    rows = claims.ruler_rows(tmp_path / "r", "CMD")
    halved, gain = rows
    value, low, high, n = claims.loss_reductions(claims.current_results(claims.read_results(tmp_path / "r")))[
        ("average", "all")
    ]
    assert n == 24 and value == pytest.approx(1 - (2 / 12) / 0.5)  # losses 1/6 and 1/2
    assert low <= value <= high
    assert halved["measured"].startswith("0.67 [") and halved["n"] == "24" and halved["command"] == "CMD"
    configs = by_config(claims.current_results(claims.read_results(tmp_path / "r")))
    diff = paired_difference(configs[("critical-snapkv", 0.2)], configs[("snapkv", 0.2)])
    assert diff is not None and gain["measured"].startswith(f"{diff['score_diff']:+.1f} pts")
    assert gain["verdict"] == "holds"  # +33 points on every task, the interval far from 0


def test_no_gain_does_not_hold_and_few_samples_cannot_tell(tmp_path: Path) -> None:
    _ruler(tmp_path / "same", critical_zero_below=6)  # the variant equals its base
    halved, gain = claims.ruler_rows(tmp_path / "same", "CMD")
    assert halved["measured"].startswith("0.00 [0.00, 0.00]") and halved["verdict"] == "does not hold"
    assert "cannot tell" in gain["verdict"]
    _ruler(tmp_path / "few", critical_zero_below=0, samples=2)
    assert all(r["verdict"] == "too few samples to tell (n=4)" for r in claims.ruler_rows(tmp_path / "few", "C"))


def test_perturbation_shares_and_drift(tmp_path: Path) -> None:
    _perturbation(tmp_path / "p", samples=10)
    rows = claims.perturbation_rows(tmp_path / "p", "CMD")
    decode, window, drift = rows
    assert decode["measured"] == "95.0% [95.0%, 95.0%] of heads" and decode["verdict"] == "holds"
    assert window["measured"] == decode["measured"]
    assert drift["measured"] == "+50.0% [+50.0%, +50.0%] reduction" and drift["verdict"] == "holds"
    _perturbation(tmp_path / "q", samples=3)
    assert claims.perturbation_rows(tmp_path / "q", "C")[0]["verdict"] == "too few samples to tell (n=3)"


def test_performance_rows_and_the_whole_document(tmp_path: Path) -> None:
    _performance(tmp_path / "perf")
    ttft, decode = claims.performance_rows(tmp_path / "perf", "CMD")
    assert ttft["measured"] == "+2.0%" and ttft["verdict"] == "above the paper's"  # 0.2 s over 10 s
    assert decode["measured"] == "+2.0% ms/token" and decode["verdict"].startswith("unchanged")
    _ruler(tmp_path / "r", critical_zero_below=2)
    _perturbation(tmp_path / "p", samples=10)
    out = tmp_path / "claims.md"
    args = [
        "--ruler",
        str(tmp_path / "r"),
        "--perturbation",
        str(tmp_path / "p"),
        "--performance",
        str(tmp_path / "perf"),
    ]
    assert claims.main([*args, "--out", str(out)]) == 0
    text = out.read_text()
    out.write_text(text + "\n" + claims.NOTES + "\nmy notes\n")
    assert claims.main([*args, "--out", str(out)]) == 0
    assert out.read_text() == text + "\n" + claims.NOTES + "\nmy notes\n"  # regenerated, notes kept
    assert text.count("\n| ") == 1 + 2 + 3 + 2  # header, RULER, perturbation, performance rows
    assert "criticalkv perturbation --out P" in text and f"--out {tmp_path / 'r'}" in text
    with pytest.raises(SystemExit):
        claims.main(["--ruler", str(tmp_path / "missing")])
