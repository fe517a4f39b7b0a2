"""Stored and background contexts on every route (issue 41, section 3; issue 42, point 13): a
context compressing, failed, deleted, made for another model, a store reopened after a kill, a
full disk; each context's uncompressed equivalent and ratio, and the access log."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors import SafetensorError

from criticalkv import CompressedCache, attach
from tests.conftest import make_tiny
from tests.helpers.lmeval_tasks import chat_tokenizer
from tests.helpers.serve_helpers import document, idle, live_server, metric, server_config, wait_until
from tests.serve.test_serve import create, error_of
from tests.serve.test_serve_context_cancel import Gate


def chat(url: str, context_id: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "q?"}], "context_id": context_id, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_every_route_answers_a_context_in_each_state(tmp_path: Path) -> None:
    with live_server(server_config(tmp_path)) as (url, engine):
        gate = Gate(engine, layer=1)
        try:
            started = httpx.post(url + "/v1/contexts", json={"text": document(9), "wait": False}, timeout=10)
            context_id = started.json()["id"]
            assert gate.entered.wait(timeout=60)
            # compressing: shown as such, listed, and a question about it is a 409 saying so
            assert httpx.get(f"{url}/v1/contexts/{context_id}").json()["status"] == "compressing"
            assert error_of(chat(url, context_id), 409)["code"] == "context_not_ready"
            assert error_of(chat(url, context_id, stream=True), 409)["code"] == "context_not_ready"
            # deleted while compressing: the compression stops, nothing is stored or listed
            deleted = httpx.delete(f"{url}/v1/contexts/{context_id}")
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        finally:
            gate.remove()
        wait_until(lambda: idle(engine))
        assert httpx.get(url + "/v1/contexts").json()["data"] == []
        assert error_of(httpx.get(f"{url}/v1/contexts/{context_id}"), 404)["code"] == "not_found"
        assert error_of(chat(url, context_id), 404)["code"] == "not_found"
        assert engine.store.stats()["on_disk"] == 0 and engine.admitted() == 0


def test_a_failed_background_context_is_a_409_naming_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with live_server(server_config(tmp_path)) as (url, engine):

        def no_room(*_: object, **__: object) -> int:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(CompressedCache, "save", no_room)
        started = httpx.post(url + "/v1/contexts", json={"text": document(9), "wait": False}, timeout=10)
        context_id = started.json()["id"]
        wait_until(lambda: idle(engine))
        failed = httpx.get(f"{url}/v1/contexts/{context_id}").json()
        assert failed["status"] == "failed" and "disk is full" in failed["error"]
        error = error_of(chat(url, context_id), 409)
        assert error["code"] == "context_failed" and "disk is full" in error["message"]
        assert httpx.delete(f"{url}/v1/contexts/{context_id}").status_code == 200
        assert error_of(chat(url, context_id), 404)["code"] == "not_found"


@pytest.mark.parametrize(
    "error",
    [
        OSError(28, "No space left on device"),
        SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })'),
    ],
)
def test_a_full_store_is_a_sentence_about_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    with live_server(server_config(tmp_path)) as (url, engine):

        def no_room(*_: object, **__: object) -> int:
            raise error

        monkeypatch.setattr(CompressedCache, "save", no_room)
        response = httpx.post(url + "/v1/contexts", json={"text": document(9)}, timeout=60)
        body = error_of(response, 507)
        assert body["code"] == "store_full" and "disk is full" in body["message"] and str(tmp_path) in body["message"]
        assert "SafetensorError" not in body["message"]
        assert httpx.get(url + "/v1/contexts").json()["data"] == [] and engine.admitted() == 0


def test_a_store_reopened_for_another_model_names_the_mismatch(tmp_path: Path) -> None:
    with live_server(server_config(tmp_path)) as (url, _):
        made = create(url, document(5))["id"]
    other = attach(make_tiny("llama", seed=1))  # same shapes, other weights
    with live_server(server_config(tmp_path), model=other) as (url, _):
        listed = httpx.get(url + "/v1/contexts").json()
        assert listed["answerable"] == 0
        [entry] = listed["data"]
        assert entry["id"] == made and entry["answerable"] is False and "another model" in entry["reason"]
        error = error_of(chat(url, made), 409)
        assert error["code"] == "context_incompatible" and "another model" in error["message"]
        fresh = create(url, document(6))["id"]
        assert chat(url, fresh).status_code == 200
        assert httpx.get(url + "/v1/contexts").json()["answerable"] == 1


def test_a_store_reopened_with_another_tokenizer_names_it_and_other_settings_still_answer(tmp_path: Path) -> None:
    """Another tokenizer (here: a chat template added) is named like another model; other storage
    or compression settings (kv bits, default method, window limits) still answer the stored context."""
    with live_server(server_config(tmp_path)) as (url, _):
        made = create(url, document(5))["id"]
    with live_server(server_config(tmp_path), tokenizer=chat_tokenizer()) as (url, _):
        error = error_of(chat(url, made), 409)
        assert error["code"] == "context_incompatible" and "another tokenizer" in error["message"]
    for settings in ({"kv_bits": 8}, {"method": "snapkv", "methods": ()}, {"max_window": 4, "window": 4}):
        with live_server(server_config(tmp_path, **settings)) as (url, _):
            assert httpx.get(url + "/v1/contexts").json()["answerable"] == 1
            assert chat(url, made, max_tokens=2).status_code == 200, settings


def test_stale_temporaries_are_removed_at_start(tmp_path: Path) -> None:
    """What a SIGKILL during a save leaves (the atomic write's temporary) is removed when a server
    opens the store again; a fresh one (a server sharing the folder may be writing it) is kept."""
    stale = tmp_path / ".ctx_0123456789abcdef01234567.ckv.abc123.tmp"
    fresh = tmp_path / ".ctx_89abcdef0123456789abcdef.ckv.def456.tmp"
    note = tmp_path / "ctx_0123456789abcdef01234567.sum.tmp"
    for path in (stale, fresh, note):
        path.write_bytes(b"\0" * 1024)
    hour_ago = time.time() - 3600
    for path in (stale, note):
        os.utime(path, (hour_ago, hour_ago))
    with live_server(server_config(tmp_path)) as (url, _):
        assert httpx.get(url + "/health").status_code == 200
    assert not stale.exists() and not note.exists() and fresh.exists()


def test_contexts_show_their_uncompressed_equivalent_and_totals(tmp_path: Path) -> None:
    with live_server(server_config(tmp_path)) as (url, _):
        first, second = create(url, document(5)), create(url, document(6, 300), budget=0.6)
        per_token = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x float32 bytes
        for info in (first, second):
            assert info["kv_bytes_full"] == info["tokens"] * per_token
            assert info["kv_ratio"] == pytest.approx(info["kv_bytes"] / info["kv_bytes_full"], abs=1e-4)
            assert 0 < info["kv_ratio"] < 1
        listed = httpx.get(url + "/v1/contexts").json()
        totals = listed["totals"]
        assert totals["kv_bytes"] == first["kv_bytes"] + second["kv_bytes"]
        assert totals["kv_bytes_full"] == first["kv_bytes_full"] + second["kv_bytes_full"]
        assert totals["kv_ratio"] == pytest.approx(totals["kv_bytes"] / totals["kv_bytes_full"], abs=1e-4)
        assert httpx.get(f"{url}/v1/contexts/{first['id']}").json()["kv_bytes_full"] == first["kv_bytes_full"]
        metrics = httpx.get(url + "/metrics").text
        assert f"criticalkv_context_bytes_full_total {totals['kv_bytes_full']}" in metrics
    with live_server(server_config(tmp_path)) as (url, _):  # read back from the files' headers
        again = {c["id"]: c for c in httpx.get(url + "/v1/contexts").json()["data"]}
        assert again[first["id"]]["kv_bytes_full"] == first["kv_bytes_full"]


def test_one_access_line_per_request(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with live_server(server_config(tmp_path)) as (url, _), caplog.at_level(logging.INFO, "criticalkv.serve.access"):
        info = create(url, document(5))
        chat(url, info["id"], max_tokens=3)
        chat(url, info["id"], max_tokens=3, stream=True)
        httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": document(7, 40), "max_tokens": 2})
        httpx.get(url + "/health")

        def access_lines() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name == "criticalkv.serve.access"]

        wait_until(lambda: len(access_lines()) >= 5)  # a line is written after its answer's last byte
    lines = access_lines()
    assert len(lines) == 5, lines
    made, asked, streamed, completed, health = lines
    assert made.startswith('"POST /v1/contexts" 200') and f"kv_bytes={info['kv_bytes']}" in made
    for line in (asked, streamed, completed):
        assert "method=" in line and "prompt_tokens=" in line and "completion_tokens=" in line
        assert "kv_bytes=" in line and "ttft_ms=" in line and "ttft_ms=None" not in line
    assert asked.startswith('"POST /v1/chat/completions" 200') and "method=critical-adakv" in asked
    assert health.startswith('"GET /health" 200')


def test_every_working_route_is_admitted_and_counted(tmp_path: Path) -> None:
    """Contexts, chat, completions and a completion's echo alone (a prefill for its scores) each
    pass admission and count in /metrics."""
    with live_server(server_config(tmp_path)) as (url, _):

        def requests() -> float:
            return metric(httpx.get(url + "/metrics").text, "criticalkv_requests_total")

        before = requests()
        info = create(url, document(5))
        assert chat(url, info["id"], max_tokens=2).status_code == 200
        body = {"model": "tiny", "prompt": document(7, 40), "max_tokens": 0, "echo": True, "logprobs": 1}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert requests() == before + 3
