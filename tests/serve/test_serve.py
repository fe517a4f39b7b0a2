"""The server, live on 127.0.0.1, driven by the official ``openai`` client and by httpx."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

import criticalkv
from criticalkv import CompressedCache, attach
from criticalkv.cli import main
from criticalkv.compat import cache_argument
from criticalkv.runtime import decode_answers, eos_ids
from criticalkv.serve import Engine, check_binding
from tests.conftest import make_tiny
from tests.helpers.serve_helpers import (
    BUDGET,
    MAX_NEW,
    WINDOW,
    check_row_memory,
    document,
    live_server,
    metric,
    server_config,
    wait_until,
)
from tests.helpers.tiny_tokenizer import char_tokenizer

QUESTIONS = ["What is the key?", "Which word comes first?", "Name a value."]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    with live_server(server_config(tmp_path_factory.mktemp("store"))) as running:
        yield running


@pytest.fixture(scope="module")
def reference() -> tuple[torch.nn.Module, object]:
    """The same tiny model (same seed), separate from the server's, and the same tokenizer."""
    return attach(make_tiny("llama")), char_tokenizer()


def expected(reference, text: str, question: str, max_new: int = MAX_NEW) -> str:
    model, tokenizer = reference
    result = criticalkv.generate(
        model, tokenizer, text, question, method="critical-adakv", budget=BUDGET, mode="question-agnostic",
        window=WINDOW, max_new_tokens=max_new,
    )  # fmt: skip
    return result.answers[0]


def client(url: str, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)


def create(url: str, text: str, **options: object) -> dict:
    response = httpx.post(url + "/v1/contexts", json={"text": text, **options}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def ask(url: str, context_id: str, question: str, stream: bool = False, max_tokens: int = MAX_NEW) -> str:
    messages = [{"role": "user", "content": question}]
    extra = {"context_id": context_id}
    c = client(url)
    if not stream:
        reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, extra_body=extra)
        return reply.choices[0].message.content or ""
    chunks = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, extra_body=extra, stream=True
    )
    parts, finishes = [], []
    for chunk in chunks:
        parts.append(chunk.choices[0].delta.content or "")
        finishes.append(chunk.choices[0].finish_reason)
    assert [f for f in finishes if f] in (["stop"], ["length"])  # exactly one end, at the end
    assert finishes[-1] is not None
    return "".join(parts)


def test_answers_equal_generate_streaming_or_not(server, reference) -> None:
    url, _ = server
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    text = document(1)
    info = create(url, text)
    assert info["tokens"] == len(text) and info["kv_bytes"] > 0 and info["id"].startswith("ctx_")
    assert httpx.get(f"{url}/v1/contexts/{info['id']}").json()["tokens"] == len(text)
    for question in QUESTIONS:
        want = expected(reference, text, question)
        assert ask(url, info["id"], question) == want
        assert ask(url, info["id"], question, stream=True) == want
    # few tokens: the answer is cut by max_tokens ("length")
    assert ask(url, info["id"], QUESTIONS[0], max_tokens=3) == expected(reference, text, QUESTIONS[0], 3)


def prompt_reply_and_expected(url: str, reference: tuple, kv_bits: int = 16) -> tuple[Any, str, int]:
    """A chat without a context (its prompt compressed for the request) on the server at ``url``,
    and what ``model.generate`` answers with the same compressed cache: (reply, answer, prompt tokens)."""
    model, tokenizer = reference
    content = document(7, 120) + " What is the key?"
    reply = client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=MAX_NEW
    )
    ids = torch.tensor([tokenizer(content + "\nAnswer:", add_special_tokens=False)["input_ids"]])
    cache = CompressedCache.for_model(model, "critical-adakv", BUDGET, window=WINDOW, kv_bits=kv_bits)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), **cache_argument(model, cache), max_new_tokens=MAX_NEW,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    want, _ = decode_answers(tokenizer, out[:, ids.shape[1] :], eos_ids(model, tokenizer))
    return reply, want[0], int(ids.shape[1])


def test_a_chat_without_context_compresses_its_prompt(server, reference) -> None:
    reply, want, prompt_tokens = prompt_reply_and_expected(server[0], reference)
    assert reply.choices[0].message.content == want
    assert reply.usage is not None and reply.usage.prompt_tokens == prompt_tokens


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def test_bad_input_answers_4xx_and_changes_nothing(server) -> None:
    url, engine = server
    info = create(url, document(2))
    before = engine.store.stats()
    chat = url + "/v1/chat/completions"
    good = {"model": "tiny", "messages": [{"role": "user", "content": "q?"}], "context_id": info["id"]}
    assert "JSON" in error_of(httpx.post(chat, content=b"{not json", headers={"content-type": "application/json"}),
                              400)["message"]  # fmt: skip
    assert error_of(httpx.post(chat, json={**good, "context_id": "ctx_" + "0" * 24}), 404)["param"] == "context_id"
    assert error_of(httpx.post(chat, json={**good, "context_id": "../../etc"}), 404)["param"] == "context_id"
    assert error_of(httpx.post(chat, json={**good, "max_tokens": 0}), 400)["param"] == "max_tokens"
    assert error_of(httpx.post(chat, json={**good, "max_tokens": MAX_NEW + 1}), 400)["param"] == "max_tokens"
    assert error_of(httpx.post(chat, json={**good, "temperature": 2.5}), 400)["param"] == "temperature"
    assert error_of(httpx.post(chat, json={**good, "budget": 0.9}), 400)["param"] == "budget"
    assert error_of(httpx.post(chat, json={**good, "model": "gpt-4"}), 404)["param"] == "model"
    empty = {**good, "messages": [{"role": "user", "content": "   "}]}
    assert error_of(httpx.post(chat, json=empty), 400)["param"] == "messages"
    assert error_of(httpx.post(chat, json={**good, "messages": []}), 400)
    contexts = url + "/v1/contexts"
    assert error_of(httpx.post(contexts, json={"text": "x" * 2000}), 400)["code"] == "context_length_exceeded"
    assert error_of(httpx.post(contexts, json={"text": document(3), "budget": 2}), 400)["param"] == "budget"
    assert error_of(httpx.post(contexts, json={"text": document(3), "method": "nope"}), 400)["param"] == "method"
    assert error_of(httpx.post(contexts, json={"text": document(3), "window": 0}), 400)["param"] == "window"
    assert error_of(httpx.post(contexts, json={"text": "short"}), 400)["param"] == "text"
    assert error_of(httpx.post(contexts, json={"text": "  "}), 400)["param"] == "text"
    assert error_of(httpx.post(contexts, json={}), 400)["param"] == "text"
    assert error_of(httpx.get(contexts + "/ctx_" + "1" * 24), 404)
    assert error_of(httpx.delete(contexts + "/ctx_" + "1" * 24), 404)
    with pytest.raises(openai.NotFoundError):
        client(url).chat.completions.create(model="tiny", messages=good["messages"], extra_body={"context_id": "x"})
    assert engine.store.stats() == before
    assert engine.active() == 0 and engine.queue_depth() == 0


def test_per_request_options_and_delete(server) -> None:
    url, engine = server
    info = create(url, document(4), method="snapkv", budget=0.5)
    assert (info["method"], info["budget"]) == ("snapkv", 0.5)
    assert ask(url, info["id"], "Why?")  # answered on the snapkv context
    mismatch = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "q"}],
        "context_id": info["id"],
        "budget": 0.4,
    }
    assert error_of(httpx.post(url + "/v1/chat/completions", json=mismatch), 400)["param"] == "budget"
    assert httpx.delete(f"{url}/v1/contexts/{info['id']}").json()["deleted"] is True
    assert httpx.get(f"{url}/v1/contexts/{info['id']}").status_code == 404
    assert not (engine.store.folder / f"{info['id']}.ckv").exists()


def test_a_full_server_answers_429(server) -> None:
    url, engine = server
    for _ in range(engine.config.max_sessions):
        engine.admit()  # occupy every slot as admitted requests do
    waited, engine.config.admission_wait_s = engine.config.admission_wait_s, 0.2
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": document(5, 40)}]}
        full = httpx.post(url + "/v1/chat/completions", json=body)
        assert error_of(full, 429)["code"] == "rate_limit_exceeded"
        assert full.headers["retry-after"] == "1"  # lm-eval's and openai's clients back off by it
        assert metric(httpx.get(url + "/metrics").text, "criticalkv_rejected_total") >= 1
    finally:
        engine.config.admission_wait_s = waited
        for _ in range(engine.config.max_sessions):
            engine.release()


def test_a_request_waits_for_a_slot_before_its_429(server) -> None:
    """Every slot taken, a request waits (up to admission_wait_s) and is answered once one frees."""
    url, engine = server
    for _ in range(engine.config.max_sessions):
        engine.admit()
    body = {"model": "tiny", "messages": [{"role": "user", "content": document(5, 40)}], "max_tokens": 2}
    answered: dict[str, httpx.Response] = {}
    client = threading.Thread(target=lambda: answered.update(r=httpx.post(url + "/v1/chat/completions", json=body)))
    client.start()
    try:
        time.sleep(0.5)  # the request has arrived; without a slot it waits (admission_wait_s is 30 s)
        assert client.is_alive() and "r" not in answered
    finally:
        engine.release()  # one slot frees: the waiting request takes it
    client.join(timeout=60)
    for _ in range(engine.config.max_sessions - 1):
        engine.release()
    assert answered["r"].status_code == 200


def test_a_client_that_disconnects_frees_its_row(server) -> None:
    url, engine = server
    info = create(url, document(6))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "q?"}], "context_id": info["id"],
            "stream": True, "max_tokens": MAX_NEW}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first event, then hang up
    assert wait_until(lambda: engine.active() == 0 and engine.admitted() == 0)  # the worker dropped the session


def test_api_key(server) -> None:
    url, engine = server
    engine.config.api_key = "s3cret"
    try:
        assert error_of(httpx.get(url + "/v1/models"), 401)["code"] == "invalid_api_key"
        assert error_of(httpx.get(url + "/metrics", headers={"Authorization": "Bearer wrong"}), 401)
        assert client(url, api_key="s3cret").models.list().data[0].id == "tiny"
    finally:
        engine.config.api_key = None


def test_binding_beyond_localhost_needs_a_key() -> None:
    check_binding("127.0.0.1", None, False)
    check_binding("0.0.0.0", "key", False)
    check_binding("0.0.0.0", None, True)
    with pytest.raises(ValueError, match="--api-key"):
        check_binding("0.0.0.0", None, False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2  # refused before loading a model


@pytest.mark.slow
def test_concurrent_clients_each_get_one_complete_answer(tmp_path: Path, reference) -> None:
    # a cap of about five contexts: some spill, and several rows (each context plus its tail) fit
    with live_server(server_config(tmp_path, memory_cap_bytes=400_000)) as running:
        bounded_load(*running, reference)


def bounded_load(url: str, engine: Engine, reference) -> None:
    shared = [document(10 + i) for i in range(3)]
    shared_ids = [create(url, text)["id"] for text in shared]
    cap = engine.config.memory_cap_bytes
    jobs = [(i % 3, QUESTIONS[i % len(QUESTIONS)], i % 2 == 0) for i in range(36)]
    jobs += [(3 + i, QUESTIONS[i % len(QUESTIONS)], i % 2 == 1) for i in range(12)]  # distinct contexts
    texts = {**dict(enumerate(shared)), **{3 + i: document(100 + i) for i in range(12)}}
    want = {(k, q): expected(reference, texts[k], q) for k, q, _ in jobs}
    scrapes: list[tuple[float, float]] = []
    texts_seen: list[str] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            text = httpx.get(url + "/metrics").text
            scrapes.append(
                (metric(text, "criticalkv_context_bytes_in_memory"), metric(text, "criticalkv_memory_cap_bytes"))
            )
            texts_seen.append(text)
            time.sleep(0.01)

    def run(job: tuple[int, str, bool]) -> tuple[tuple[int, str], str]:
        key, question, stream = job
        context_id = shared_ids[key] if key < 3 else create(url, texts[key])["id"]
        return (key, question), ask(url, context_id, question, stream=stream)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(run, jobs))
    stop.set()
    scraper.join()
    assert len(answers) == len(jobs)
    for key, answer in answers:
        assert answer == want[key], key
    assert scrapes and all(held <= cap_seen == cap for held, cap_seen in scrapes)
    rows_seen = [check_row_memory(text)[0] for text in texts_seen]  # the rows' bytes add up, within the cap
    assert max(rows_seen) >= 2  # the scrapes saw several rows decoding at once
    stats = engine.store.stats()
    assert stats["on_disk"] > stats["in_memory"]  # the cap made some contexts spill ...
    assert stats["bytes_total"] > cap  # ... and they came back on demand for the answers above
    assert wait_until(lambda: engine.active() == 0 and engine.admitted() == 0)  # the last rows let go


def test_an_oversized_context_is_refused(tmp_path: Path) -> None:
    with live_server(server_config(tmp_path, memory_cap_bytes=10_000)) as (url, engine):
        assert error_of(httpx.post(url + "/v1/contexts", json={"text": document(1)}), 413)["param"] == "text"
        assert engine.store.stats()["on_disk"] == 0 and not list(tmp_path.glob("*.ckv"))
