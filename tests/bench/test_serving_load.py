"""benchmarks/serving_load.py end to end on a tiny model: a live server per configuration, a burst,
the stall measurement with the document sent either way, the rerun that skips what is done, the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_tiny
from tests.helpers.serve_helpers import free_port
from tests.helpers.tiny_tokenizer import char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serving_load.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_burst_and_the_prompt_stalls_are_recorded_once_each(tmp_path: Path) -> None:
    model_dir, out = tmp_path / "tiny", tmp_path / "load.jsonl"
    make_tiny("llama").save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    common = ["--model", str(model_dir), "--out", str(out), "--configs", "critical-adakv:0.5", "--words", "40",
              "--documents", "2", "--clients", "2", "--repeats", "1", "--ttft-repeats", "0", "--max-tokens", "6",
              "--window", "8", "--memory-cap-mib", "4", "--store-root", str(tmp_path / "stores"),
              "--stall-words", "60", "--port", str(free_port())]  # fmt: skip
    for offload in ("0", "1000000000"):  # the prompt compressed beside the decode steps, then on the worker
        done = run(*common, "--stall-via", "chat", "--offload-prompt-tokens", offload)
        assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("contexts") == 1 and kinds.count("burst") == 1  # the later runs reused and skipped them
    stalls = [r for r in records if r["kind"] == "stall"]
    assert [(r["stall_via"], r["offload_prompt_tokens"]) for r in stalls] == [("chat", 0), ("chat", 1000000000)]
    for r in stalls:
        assert r["streamed_tokens"] >= 2 and len(r["gaps_s"]) == r["streamed_tokens"] - 1
        assert r["document_tokens"] > 60 and r["max_gap_s"] == max(r["gaps_s"])
    again = run(*common, "--stall-via", "chat", "--offload-prompt-tokens", "0")
    assert again.returncode == 0 and len(out.read_text().splitlines()) == len(records)
    table = run("--out", str(out), "--report")
    assert table.returncode == 0 and table.stdout.count("| critical-adakv | 0.5 | 16 | chat |") == 2


def test_the_report_keeps_storage_widths_of_one_method_apart(tmp_path: Path) -> None:
    out = tmp_path / "load.jsonl"
    burst = {"kind": "burst", "method": "critical-adakv", "budget": 0.2, "clients": 4, "repeat": 0, "wall_s": 2.0,
             "tokens": 32, "decode_rows_max": 4, "start_rows_max": 2, "ttft_mean_s": 0.5}  # fmt: skip
    lines = [{**burst, "kv_bits": 16, "tokens_per_s": 8.0}, {**burst, "kv_bits": 4, "tokens_per_s": 6.0}]
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    table = run("--out", str(out), "--report")
    assert table.returncode == 0, table.stderr
    assert "| critical-adakv | 0.2 | 16 | 4 | 8.000 | 8.000 |" in table.stdout
    assert "| critical-adakv | 0.2 | 4 | 4 | 6.000 | 6.000 |" in table.stdout
