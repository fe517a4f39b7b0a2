"""A request too small (or otherwise unfit) for its compression answers 400 before any work, not 500.

The live server (tiny model, window 8, budget 0.4) driven by the official ``openai`` client:
a context or prompt whose budget cannot hold the observation window is refused with an
OpenAI-style error naming the parameter at fault, and the server's state does not change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

import criticalkv
from criticalkv import attach
from criticalkv.serve import Engine
from tests.conftest import make_tiny
from tests.helpers.serve_helpers import BUDGET, MAX_NEW, WINDOW, document, live_server, server_config
from tests.helpers.tiny_tokenizer import char_tokenizer
from tests.serve.test_serve import ask, client, create


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    config = server_config(tmp_path_factory.mktemp("store"), methods=("snapkv", "kvzip"))
    with live_server(config) as running:
        yield running


def refused(call: object, **kwargs: object) -> dict:
    """The error body of a request the openai client sees refused with 400."""
    with pytest.raises(openai.BadRequestError) as caught:
        call(**kwargs)  # type: ignore[operator]
    assert caught.value.status_code == 400
    body = caught.value.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    return body


def chat(url: str, content: str, **extra: object) -> dict:
    create_chat = client(url).chat.completions.create
    messages = [{"role": "user", "content": content}]
    return refused(create_chat, model="tiny", messages=messages, max_tokens=MAX_NEW, extra_body=extra or None)


def test_a_prompt_too_short_for_the_budget_it_sets_answers_400(server: tuple[str, Engine]) -> None:
    url, engine = server
    before = engine.store.stats()
    # the parameter the request set is named: a budget that keeps fewer than the window ...
    body = chat(url, document(1, 30), budget=0.2)  # 38 tokens: 7 < 8
    assert (body["param"], body["code"]) == ("budget", "context_too_short")
    assert "38 tokens" in body["message"] and "window" in body["message"]
    # ... or a window larger than what the budget keeps
    assert chat(url, document(1, 30), window=20)["param"] == "window"  # 38 tokens: 15 < 20
    assert engine.store.stats() == before
    assert engine.active() == 0 and engine.queue_depth() == 0 and engine.admitted() == 0


@pytest.mark.parametrize("content", ["Hi", "H"])
def test_a_prompt_too_short_for_the_servers_defaults_is_kept_whole(server: tuple[str, Engine], content: str) -> None:
    """ "Hi" + "\nAnswer:" is 10 tokens: floor(0.4 * 10) = 4 entries per head cannot hold the window
    of 8, so at the server's defaults the prompt is kept whole: the answer is the full cache's."""
    url, _ = server
    model, tokenizer = attach(make_tiny("llama")), char_tokenizer()
    reply = client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=MAX_NEW
    )
    ids = torch.tensor([tokenizer(content + "\nAnswer:")["input_ids"]])
    assert reply.usage is not None and reply.usage.prompt_tokens == ids.shape[1]
    whole = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)[0, ids.shape[1] :]
    assert reply.choices[0].message.content == tokenizer.decode(whole, skip_special_tokens=True)


def test_a_short_prompt_kept_whole_at_budget_1_is_answered(server: tuple[str, Engine]) -> None:
    url, _ = server
    reply = client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, extra_body={"budget": 1.0}
    )
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage is not None


def test_a_document_too_short_for_its_budget_answers_400(server: tuple[str, Engine]) -> None:
    url, engine = server
    before = engine.store.stats()
    contexts = url + "/v1/contexts"
    short = httpx.post(contexts, json={"text": document(2, 12)})  # 12 tokens >= window, but 4 kept < 8
    assert short.status_code == 400, short.text
    assert short.json()["error"]["param"] == "text" and short.json()["error"]["code"] == "context_too_short"
    assert httpx.post(contexts, json={"text": document(2, 30), "window": 20}).json()["error"]["param"] == "window"
    assert httpx.post(contexts, json={"text": document(2, 30), "budget": 0.2}).json()["error"]["param"] == "budget"
    assert engine.store.stats() == before
    assert engine.admitted() == 0
    # the boundary: 20 tokens at 0.4 keep exactly the window (8 entries per head), which is accepted
    info = create(url, document(2, 20))
    assert info["tokens"] == 20
    assert ask(url, info["id"], "Why?")


def test_kvzip_contexts_are_served_as_generate_answers(server: tuple[str, Engine]) -> None:
    url, _ = server
    model, tokenizer = attach(make_tiny("llama")), char_tokenizer()
    text, question = document(3), "What is the key?"
    info = create(url, text, method="kvzip")
    want = criticalkv.generate(
        model, tokenizer, text, question, method="kvzip", budget=BUDGET, mode="question-agnostic", window=WINDOW,
        max_new_tokens=MAX_NEW,
    ).answers[0]  # fmt: skip
    assert ask(url, info["id"], question) == want


def test_methods_the_model_cannot_serve_are_refused_at_startup(tmp_path: Path) -> None:
    model, tokenizer = attach(make_tiny("llama")), char_tokenizer()
    with pytest.raises(ValueError, match=r"'headkv' cannot be served on this model.*head"):
        Engine(model, tokenizer, server_config(tmp_path, methods=("headkv",)))


@pytest.mark.parametrize("path", ["/v1/contexts", "/v1/chat/completions"])
def test_a_lone_surrogate_is_a_400_naming_the_field(server: tuple[str, Engine], path: str) -> None:
    """Issue 30, case 7: a lone surrogate ("\\ud800" is valid JSON) in a document or a message was
    a 500 text/plain that reset the keep-alive connection; now a 400 naming the field, and the
    same connection answers the next request."""
    url, _ = server
    raw = '"some text \\ud800 and more"'  # the escape itself, as a client sends it
    body = (
        '{"text": ' + raw + "}"
        if path == "/v1/contexts"
        else '{"model": "tiny", "messages": [{"role": "user", "content": ' + raw + "}]}"
    )
    with httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post(path, content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert "lone surrogate (\\ud800)" in error["message"]
        assert error["param"] == ("text" if path == "/v1/contexts" else "messages.0.content")
        assert http.get("/v1/models").status_code == 200  # the connection still serves


def test_a_body_over_the_limit_is_a_413_before_it_is_read(tmp_path: Path) -> None:
    """Issue 30, case 7: a 20 MB body was tokenised on the event loop before admission (every route
    stopped answering for 26-36 s, memory grew 1.6 GB); there was no body limit. Now a body over
    ``max_body_bytes`` is refused by its Content-Length, unread, and the server goes on answering."""
    config = server_config(tmp_path / "store", max_body_bytes=4096)
    with live_server(config) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post("/v1/contexts", json={"text": "x" * 10_000})
        assert answer.status_code == 413
        error = answer.json()["error"]
        assert error["code"] == "request_too_large"
        assert "more than this server accepts (4096 bytes" in error["message"]
        assert http.post("/v1/contexts", json={"text": document(1)}).status_code == 200


def test_a_chunked_body_over_the_limit_is_a_413_and_one_under_it_is_served(tmp_path: Path) -> None:
    """A body sent without a Content-Length (chunked) is counted as it arrives."""

    def chunks(text: str) -> Iterator[bytes]:
        data = json.dumps({"text": text}).encode()
        for start in range(0, len(data), 1000):
            yield data[start : start + 1000]

    config = server_config(tmp_path / "store", max_body_bytes=4096)
    headers = {"content-type": "application/json"}
    with live_server(config) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post("/v1/contexts", content=chunks("x" * 10_000), headers=headers)
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
        served = http.post("/v1/contexts", content=chunks(document(2)), headers=headers)
        assert served.status_code == 200, served.text
