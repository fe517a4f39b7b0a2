"""``criticalkv serve`` killed with SIGKILL and restarted on its store: every acknowledged context reloads intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_tiny
from tests.helpers.serve_helpers import BUDGET, WINDOW, document, free_port
from tests.helpers.tiny_tokenizer import char_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def start(model_dir: Path, store: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "criticalkv.cli", "serve", "--model", str(model_dir), "--store", str(store),
               "--port", str(port), "--budget", str(BUDGET), "--window", str(WINDOW), "--max-new-tokens", "8",
               "--memory-cap", "0.1"]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(1200):  # bounded: about two minutes on a loaded machine
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read().decode() if process.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("the server did not answer")


def answer(url: str, context_id: str) -> str:
    body = {"model": str(url.split("|")[1]), "messages": [{"role": "user", "content": "Which word?"}],
            "context_id": context_id}  # fmt: skip
    response = httpx.post(url.split("|")[0] + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


@pytest.mark.slow
def test_acknowledged_contexts_survive_sigkill(tmp_path: Path) -> None:
    model_dir, store = tmp_path / "tiny", tmp_path / "store"
    make_tiny("llama").save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = start(model_dir, store, port)
    try:
        infos, answers = [], {}
        for i in range(5):
            response = httpx.post(base + "/v1/contexts", json={"text": document(i)}, timeout=60)
            assert response.status_code == 200, response.text
            infos.append(response.json())
        for info in infos:
            answers[info["id"]] = answer(f"{base}|{model_dir}", info["id"])
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    assert not list(store.glob(".*.tmp"))
    process = start(model_dir, store, port)
    try:
        for info in infos:
            again = httpx.get(f"{base}/v1/contexts/{info['id']}", timeout=10).json()
            assert {k: again[k] for k in ("tokens", "kv_bytes", "method", "budget")} == {
                k: info[k] for k in ("tokens", "kv_bytes", "method", "budget")
            }
            assert answer(f"{base}|{model_dir}", info["id"]) == answers[info["id"]]
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
