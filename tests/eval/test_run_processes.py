"""Real processes on one results folder: two `criticalkv eval` at once, and a sweep killed with
SIGKILL at random (seeded) points and resumed, locally and on Ray (see docs/reliability-runs.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from criticalkv.eval import results as sweep_results
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
METHODS = "full,snapkv,critical-snapkv,h2o"
EXACT = ("score", "partial", "prediction", "answers", "kv_bytes", "kv_bytes_full", "new_tokens", "context_tokens")
CLOSE = ("nll", "kl", "top1")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama and the character tokenizer, saved where `criticalkv eval --model` loads them."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    make_tiny("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def eval_command(model: Path, out: Path, *extra: str, samples: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "criticalkv.cli",
        "eval",
        "--model",
        str(model),
        "--tasks",
        "niah_single_1,qa_1",
        "--lengths",
        "600",
        "--methods",
        METHODS,
        "--budgets",
        "0.3,0.6",
        "--samples",
        str(samples),
        "--window",
        "8",
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
        *extra,
    ]


def start(command: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str]:
    _, err = process.communicate(timeout=timeout)
    return process.returncode, err


def line_count(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def check_complete(out: Path, expected: int) -> dict[str, dict[str, Any]]:
    """Every line of ``out/results.jsonl`` is a complete result, one per key, ``expected`` keys."""
    lines = (out / sweep_results.RESULTS).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert all(sweep_results.problem(r) is None for r in records)
    keys = [sweep_results.result_key(r) for r in records]
    assert len(keys) == len(set(keys)) == expected
    return dict(zip(keys, records, strict=True))


def assert_same_scores(records: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]]) -> None:
    assert set(records) == set(reference)
    for key, record in records.items():
        ref = reference[key]
        assert {k: record[k] for k in EXACT} == {k: ref[k] for k in EXACT}, key
        for field in CLOSE:
            assert record[field] == pytest.approx(ref[field], abs=1e-4), (key, field)


# the lock module alone (stdlib and filelock): the holder starts in well under a second
HOLD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("lock", sys.argv[2])
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
with lock.writer_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_folder_held_by_another_process_is_refused_until_that_process_dies(tmp_path: Path) -> None:
    """A real second process holds the OS lock; SIGKILL releases it (no stale lock to clean)."""
    from criticalkv.runs import FolderBusy, writer_lock

    out = tmp_path / "run"
    holder = start([sys.executable, "-c", HOLD, str(out), str(ROOT / "src/criticalkv/runs/lock.py")])
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        busy = rf"another process \(pid {holder.pid} on .*\) is writing to {out}"
        with pytest.raises(FolderBusy, match=busy), writer_lock(out, wait=0.3):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    with writer_lock(out, wait=5):  # the kernel released the dead holder's lock
        assert json.loads((out / "writer.json").read_text())["pid"] == os.getpid()
    assert not (out / "writer.json").exists()


@pytest.mark.slow
def test_two_evals_at_once_write_each_key_once(model_folder: Path, tmp_path: Path) -> None:
    """Started together: one writes, the other waits for the lock, then finds everything done."""
    out = tmp_path / "run"
    first, second = (start(eval_command(model_folder, out, "--wait", "-1")) for _ in range(2))
    (rc1, err1), (rc2, err2) = finish(first), finish(second)
    assert (rc1, rc2) == (0, 0), err1 + err2
    check_complete(out, 2 * 2 * 7)
    # a third, told not to wait, while a fourth holds the folder: refused with a sentence, nothing written
    holder = start(eval_command(model_folder, out, "--wait", "-1", samples=4))
    deadline = time.monotonic() + 120
    while not (out / "writer.json").exists() and holder.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = start(eval_command(model_folder, out, "--wait", "0", samples=4))
    rc3, err3 = finish(refused)
    rc4, err4 = finish(holder)
    assert rc4 == 0, err4
    if rc3 != 0:  # the holder may have finished before the refused one started
        assert rc3 == 2 and f"another process (pid {holder.pid} on " in err3 and f"is writing to {out}" in err3
    check_complete(out, 4 * 2 * 7)


def _kill_and_resume(command: list[str], out: Path, expected: int, seed: int, kills: int) -> list[int]:
    """Start ``command``, SIGKILL it when the results reach a random line count (or at a random
    moment of its start-up), ``kills`` times; then let it finish. Returns the line counts at each kill."""
    rng = random.Random(seed)
    counts = []
    for _ in range(kills):
        target = rng.randrange(0, expected)
        process = start(command)
        deadline = time.monotonic() + 240
        if target == 0:
            time.sleep(rng.uniform(0.5, 6.0))  # during imports, model loading or the first sample
        else:
            while line_count(out / sweep_results.RESULTS) < target and process.poll() is None:
                assert time.monotonic() < deadline, "the sweep made no progress"
                time.sleep(0.005)
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.communicate()
        counts.append(line_count(out / sweep_results.RESULTS))
    rc, err = finish(start(command))
    assert rc == 0, err
    assert any(0 < count < expected for count in counts), counts  # some kills landed mid-sweep
    return counts


def _uninterrupted(model_folder: Path, tmp_path: Path, expected: int) -> dict[str, dict[str, Any]]:
    """The records of the same sweep run once without interruption (the reference)."""
    reference_out = tmp_path / "reference"
    rc, err = finish(start(eval_command(model_folder, reference_out, samples=3)))
    assert rc == 0, err
    return check_complete(reference_out, expected)


@pytest.mark.slow
def test_a_sweep_killed_at_random_points_resumes_to_the_uninterrupted_result(
    model_folder: Path, tmp_path: Path
) -> None:
    expected = 3 * 2 * 7
    reference = _uninterrupted(model_folder, tmp_path, expected)
    out = tmp_path / "killed"
    _kill_and_resume(eval_command(model_folder, out, samples=3), out, expected, seed=14, kills=5)
    assert_same_scores(check_complete(out, expected), reference)
    run = json.loads((out / sweep_results.RUN).read_text())
    assert 1 <= len(run["runs"]) <= 6  # one entry per run that got as far as the folder


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_a_ray_sweep_killed_at_random_points_resumes_to_the_uninterrupted_result(
    model_folder: Path, tmp_path: Path
) -> None:
    """The driver (the only writer) is killed; the local cluster it started goes with it."""
    expected = 3 * 2 * 7
    reference = _uninterrupted(model_folder, tmp_path, expected)
    out = tmp_path / "killed"
    ray = ("--ray", "--ray-workers", "1", "--ray-cpus-per-worker", "1")
    _kill_and_resume(eval_command(model_folder, out, *ray, samples=3), out, expected, seed=15, kills=2)
    assert_same_scores(check_complete(out, expected), reference)
