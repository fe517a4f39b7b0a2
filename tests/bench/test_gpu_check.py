"""benchmarks/gpu_check.py (``make gpu-check``): its CPU half runs, says there is no CUDA device, exits 0
and writes nothing; its Triton check and its docs/results/gpu.md, exercised on the CPU."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from criticalkv.bench.record import BenchRecord
from criticalkv.cache.quantized import KVQuantization
from criticalkv.ops import ragged_decode_reference

ROOT = Path(__file__).resolve().parents[2]


def _load() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def _state(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def test_the_cpu_half_passes_says_so_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU half even where a GPU is
    before = _state(gpu_check.DOC)
    assert gpu_check.main(["--decode-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "no CUDA device: ran the CPU checks only"
    assert "[op] torch reference vs a loop over sequences" in out and ": pass" in out
    for method in ("full", "snapkv", "adakv", "critical-adakv"):
        assert f"[bench] criticalkv {method} budget" in out
    assert "4-bit: prefill+compress" in out and "raised" not in out and "FAIL" not in out
    assert _state(gpu_check.DOC) == before  # docs/results/gpu.md neither written nor changed


def _fake_triton(monkeypatch: pytest.MonkeyPatch, kernel: object) -> None:
    module = types.ModuleType(gpu_check.TRITON_MODULE)
    module.__spec__ = importlib.machinery.ModuleSpec(gpu_check.TRITON_MODULE, None)
    module.triton_ragged_decode = kernel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, gpu_check.TRITON_MODULE, module)


def test_the_triton_check_passes_the_reference_and_fails_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_triton(monkeypatch, ragged_decode_reference)
    ok, lines = gpu_check.check_triton_op("cpu")
    assert ok and len(lines) == len(gpu_check.OP_CASES) and all(line.endswith(" pass") for line in lines)
    _fake_triton(monkeypatch, lambda **inputs: torch.zeros_like(inputs["query"]))
    ok, lines = gpu_check.check_triton_op("cpu")
    assert not ok and any(line.endswith(" FAIL") for line in lines)


def test_a_missing_triton_module_is_one_line() -> None:
    if importlib.util.find_spec(gpu_check.TRITON_MODULE) is not None:
        pytest.skip("criticalkv.ops.triton_ragged exists in this tree")
    assert gpu_check.check_triton_op() == (
        True,
        [f"{gpu_check.TRITON_MODULE} is not in this tree: Triton check skipped"],
    )


def test_the_pytest_summary_line() -> None:
    output = "....\nSKIPPED [2] tests/cache/test_memory.py:116: why\n===== 459 passed, 2 skipped in 68.83s =====\n"
    assert gpu_check.summary_line(output) == "459 passed, 2 skipped in 68.83s"
    assert gpu_check.summary_line("ERROR: usage\n") == "ERROR: usage"


def test_the_doc_holds_what_was_measured(tmp_path: Path) -> None:
    record = BenchRecord(
        impl="criticalkv", method="adakv", context_tokens=32768, budget=0.1, batch_size=1, prefill_s=0.5,
        compress_s=0.02, ttft_s=0.52, decode_ms_per_token=7.25, decode_tokens=16, tokens_per_s=137.9,
        kv_bytes=53687091, kv_bytes_full=536870912, peak_rss_bytes=None, peak_device_bytes=5 * 2**30,
        device="cuda:0", storage=KVQuantization(4),
    )  # fmt: skip
    report = gpu_check.Report(device="GPU X, 80.0 GiB", tests="3 passed in 1.0s", op=["bfloat16 16 bits: pass"])
    report.model, report.records, report.notes = "LlamaForCausalLM, random weights", [record], ["a note"]
    path = tmp_path / "gpu.md"
    gpu_check.write_doc(report, ["--tokens", "32768"], path)
    text = path.read_text()
    assert "GPU X, 80.0 GiB" in text and "`python benchmarks/gpu_check.py --tokens 32768`" in text
    assert "3 passed in 1.0s" in text and "- bfloat16 16 bits: pass" in text and "- a note" in text
    assert "| criticalkv | adakv | 0.1 | 4 | 0.520 | 0.020 | 7.25 | 51.2 | 0.100 | 5.00 |" in text
    assert "None" not in text and "nan" not in text
