"""The server as a Ray Serve deployment on a local Ray cluster, and stores shared by servers."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from criticalkv import CacheSpec, CompressedCache, attach
from criticalkv.cli import main
from criticalkv.runtime import prefill_into
from criticalkv.serve.errors import APIError
from criticalkv.serve.store import ContextStore
from tests.conftest import make_tiny, padded_batch
from tests.helpers.serve_helpers import MAX_NEW, document, free_port, live_server, server_config
from tests.helpers.tiny_tokenizer import char_tokenizer

HAVE_SERVE = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
QUESTIONS = ["What is the key?", "Name a value."]
ROOT = Path(__file__).resolve().parents[2]


# --- a store folder shared by two servers (fast) ------------------------------------------------
def test_a_store_finds_contexts_another_stored_and_forgets_deleted_ones(tmp_path: Path) -> None:
    model, tokenizer = attach(make_tiny("llama")), char_tokenizer()
    first = ContextStore(tmp_path, 10**9, model, tokenizer)
    second = ContextStore(tmp_path, 10**9, model, tokenizer)
    ids, mask = padded_batch([40], seed=5)
    cache = CompressedCache.for_model(model, "critical-adakv", 0.4, window=8)
    prefill_into(model, cache, ids, mask)
    entry = first.add(cache, 40, CacheSpec.of("critical-adakv", 0.4, 8))
    assert second.has(entry.id)  # second started before the context existed
    assert second.info(entry.id)["tokens"] == 40
    _, loaded = second.get(entry.id)
    assert torch.equal(loaded.kept_entries(), cache.kept_entries())
    for mine, theirs in zip(cache.keep_masks(), loaded.keep_masks(), strict=True):
        assert torch.equal(mine, theirs)
    second.delete(entry.id)
    assert not first.has(entry.id)  # first held it in memory; the folder decides
    with pytest.raises(APIError) as raised:
        first.get(entry.id)
    assert raised.value.status == 404
    assert not second.has("ctx_" + "0" * 24)


# --- the command ----------------------------------------------------------------------------------
def test_ray_needs_a_shared_store_and_positive_replicas() -> None:
    assert main(["serve", "--ray"]) == 2  # no --store: refused before anything starts
    assert main(["serve", "--ray", "--store", "x", "--replicas", "0"]) == 2


def _saved_tiny(folder: Path) -> Path:
    make_tiny("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ray_command(model: Path, store: Path, port: int, replicas: int) -> list[str]:
    return [sys.executable, "-m", "criticalkv.cli", "serve", "--ray", "--replicas", str(replicas), "--replica-cpus",
            "0.5", "--model", str(model), "--store", str(store), "--port", str(port), "--budget", "0.4", "--window",
            "8", "--max-new-tokens", str(MAX_NEW), "--methods", "snapkv"]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _until_answering(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    for _ in range(1800):  # bounded: about three minutes on a loaded machine
        assert process.poll() is None, log.read_text(errors="replace")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the Ray deployment did not answer")


@pytest.mark.slow
def test_the_command_serves_on_ray_and_shares_its_store(tmp_path: Path) -> None:
    if not HAVE_SERVE:
        pytest.skip("Ray Serve is not installed (pip install 'ray[serve]')")
    model, store, port = _saved_tiny(tmp_path / "tiny"), tmp_path / "store", free_port()
    url = f"http://127.0.0.1:{port}"
    env, command = _env(), _ray_command(model, store, port, replicas=2)
    # the command's log goes to a file: an unread pipe fills up and blocks the process on shutdown
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        # started as `cmd &` from a script starts it (CI runners, init scripts): SIGINT inherited as
        # ignored, which Python keeps; the command must install its own handler to stop on it
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=sink, preexec_fn=_ignore_sigint)
    try:
        _until_answering(process, url, log)
        made = _create(url, document(21))
        through_ray = _ask(url, QUESTIONS[0], made["id"], model=str(model))
        # a single server started on the same folder answers the context the deployment stored
        with live_server(server_config(store)) as (single, _):
            assert _ask(single, QUESTIONS[0], made["id"]) == through_ray
        # wait, bounded, until the command says the application is up (both replicas deployed)
        for _ in range(1800):
            if "is ready at" in log.read_text(errors="replace"):
                break
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGINT)  # the command shuts Ray Serve and its cluster down
        try:
            # Ray Serve and its cluster can take minutes to stop on a loaded 2-core box
            assert process.wait(timeout=300) == 0, log.read_text(errors="replace")[-4000:]
        finally:
            if process.poll() is None:
                process.kill()


@pytest.mark.slow
def test_sigterm_stops_every_process_the_command_started(tmp_path: Path) -> None:
    """``criticalkv serve --ray`` started Ray's processes (GCS, raylet, its agents, the replica and
    the proxy); after SIGTERM the command exits and every process below it is gone (bounded waits)."""
    if not HAVE_SERVE:
        pytest.skip("Ray Serve is not installed (pip install 'ray[serve]')")
    import psutil

    model, store, port = _saved_tiny(tmp_path / "tiny"), tmp_path / "store", free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(_ray_command(model, store, port, replicas=1), env=_env(), stdout=subprocess.DEVNULL,
                                   stderr=sink, start_new_session=True)  # fmt: skip
    try:
        _until_answering(process, f"http://127.0.0.1:{port}", log)
        started = psutil.Process(process.pid).children(recursive=True)  # the tree while it serves
        names = sorted({p.name() for p in started if p.is_running()})
        assert len(started) >= 3, names  # at least the GCS, the raylet and the replica
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=300) == 0, log.read_text(errors="replace")[-4000:]
        _, alive = psutil.wait_procs(started, timeout=60)  # bounded: the processes' own exits
        left = sorted(f"{p.pid} {p.name()}" for p in alive if p.is_running())
        assert not left, f"left running after SIGTERM: {left}"
    finally:
        if process.poll() is None:
            process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever a failed run left in its session


# --- the Ray Serve deployment (slow: a local cluster, two replicas) -----------------------------
@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    if not HAVE_SERVE:
        pytest.skip("Ray Serve is not installed (pip install 'ray[serve]')")
    import ray
    from ray import serve

    from criticalkv.serve.ray_deployment import build_application, start

    folder = _saved_tiny(tmp_path_factory.mktemp("models") / "tiny-llama")
    store = tmp_path_factory.mktemp("shared-store")
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        start(build_application(server_config(store), str(folder), replicas=2, num_cpus=0.5), "127.0.0.1", port)
        yield f"http://127.0.0.1:{port}", store
    finally:
        serve.shutdown()
        ray.shutdown()


def _ask(url: str, question: str, context_id: str | None = None, text: str | None = None, model: str = "tiny") -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    content = question if text is None else f"{text}\n\n{question}"
    extra: dict[str, Any] = {"context_id": context_id} if context_id else {}
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=MAX_NEW, extra_body=extra
    )
    return reply.choices[0].message.content or ""


def _create(url: str, text: str) -> dict[str, Any]:
    response = httpx.post(url + "/v1/contexts", json={"text": text}, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.mark.slow
def test_ray_serve_answers_like_the_single_server(deployment: tuple[str, Path], tmp_path: Path) -> None:
    url, store = deployment
    texts = [document(11), document(12)]
    created = [_create(url, text) for text in texts]
    assert all((store / f"{c['id']}.ckv").is_file() for c in created)  # on the shared folder
    # every replica answers every context: ask each one several times (the router spreads them)
    through_ray = {(c["id"], q): {_ask(url, q, c["id"]) for _ in range(4)} for c in created for q in QUESTIONS}
    assert all(len(answers) == 1 for answers in through_ray.values())
    with live_server(server_config(tmp_path / "single")) as (single, _):
        for text, c in zip(texts, created, strict=True):
            again = _create(single, text)
            assert (again["tokens"], again["kv_bytes"]) == (c["tokens"], c["kv_bytes"])
            for q in QUESTIONS:
                assert through_ray[(c["id"], q)] == {_ask(single, q, again["id"])}
        assert _ask(url, QUESTIONS[0], text=texts[0]) == _ask(single, QUESTIONS[0], text=texts[0])
    # streaming through Ray Serve's proxy gives the same answer, in one or more chunks
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=MAX_NEW,
            extra_body={"context_id": created[0]["id"]}, stream=True,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks) in through_ray[(created[0]["id"], QUESTIONS[0])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] in (["stop"], ["length"])


@pytest.mark.slow
def test_ray_serve_deletes_for_every_replica_and_answers_404(deployment: tuple[str, Path]) -> None:
    url, _ = deployment
    made = _create(url, document(13))
    assert httpx.delete(f"{url}/v1/contexts/{made['id']}", timeout=60).status_code == 200
    for _ in range(4):
        response = httpx.get(f"{url}/v1/contexts/{made['id']}", timeout=60)
        assert response.status_code == 404
        assert "no context" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        _ask(url, QUESTIONS[0], made["id"])
