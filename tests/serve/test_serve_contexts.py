"""Contexts compressed in the background, the contexts list, ``/health`` and the listening line
(issue 29, points 2 and 8)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from criticalkv import attach
from criticalkv.serve import Engine, build_app
from criticalkv.serve.listen import AnnouncingServer
from tests.conftest import make_tiny
from tests.helpers.serve_helpers import document, free_socket, live_server, server_config
from tests.helpers.tiny_tokenizer import char_tokenizer


def _until_settled(url: str, context_id: str) -> dict:
    """The context's description once it is no longer compressing (60 s at most)."""
    deadline = time.monotonic() + 60
    while True:
        info = httpx.get(f"{url}/v1/contexts/{context_id}", timeout=10).json()
        if info["status"] != "compressing" or time.monotonic() > deadline:
            return info
        assert info["elapsed_s"] >= 0
        time.sleep(0.05)


def test_a_background_context_answers_202_then_becomes_ready(tmp_path: Path) -> None:
    with live_server(server_config(tmp_path)) as (url, _):
        text = document(3)
        started = httpx.post(url + "/v1/contexts", json={"text": text, "wait": False}, timeout=10)
        assert started.status_code == 202, started.text
        first = started.json()
        assert first["status"] == "compressing" and first["id"].startswith("ctx_") and first["tokens"] == len(text)
        ready = _until_settled(url, first["id"])
        assert ready["status"] == "ready" and ready["kv_bytes"] > 0 and ready["tokens"] == len(text)
        blocking = httpx.post(url + "/v1/contexts", json={"text": document(4)}, timeout=60).json()
        assert blocking["status"] == "ready"
        listed = httpx.get(url + "/v1/contexts", timeout=10).json()["data"]
        assert sorted(c["id"] for c in listed) == sorted([first["id"], blocking["id"]])
        for entry in listed:
            assert {"id", "tokens", "kv_bytes", "status", "created"} <= set(entry) and entry["status"] == "ready"
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["model"] == "tiny"


def test_a_background_context_that_fails_says_why(tmp_path: Path) -> None:
    with live_server(server_config(tmp_path, memory_cap_bytes=10_000)) as (url, engine):
        started = httpx.post(url + "/v1/contexts", json={"text": document(1), "wait": False}, timeout=10).json()
        failed = _until_settled(url, started["id"])
        assert failed["status"] == "failed" and "memory cap" in failed["error"]
        assert [c["status"] for c in httpx.get(url + "/v1/contexts", timeout=10).json()["data"]] == ["failed"]
        assert httpx.delete(f"{url}/v1/contexts/{started['id']}", timeout=10).status_code == 200
        assert httpx.get(f"{url}/v1/contexts/{started['id']}", timeout=10).status_code == 404
        assert engine.store.stats()["on_disk"] == 0


def test_the_server_says_where_it_listens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine = Engine(attach(make_tiny("llama")), char_tokenizer(), server_config(tmp_path))
    sock = free_socket()
    server = AnnouncingServer(uvicorn.Config(build_app(engine), host="127.0.0.1", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
    assert f"listening on {url}\n" in capsys.readouterr().out
