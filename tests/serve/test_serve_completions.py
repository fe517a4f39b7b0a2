"""``POST /v1/completions`` and conversations on a stored context, on a live server (127.0.0.1)
with the tiny model and the character tokenizer with a chat template."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tokenizers import decoders

from criticalkv.serve import Engine
from criticalkv.serve.conversation import conversation_ids
from tests.conftest import make_tiny
from tests.helpers.lmeval_tasks import chat_tokenizer
from tests.helpers.serve_helpers import document, live_server, server_config

PROMPT = "The quick brown fox jumps over the lazy dog; the five boxing wizards jump quickly."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    config = server_config(tmp_path_factory.mktemp("store"), method="full", budget=1.0, methods=("snapkv",))
    tokenizer = chat_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # decodes to the text it encoded (no spaces between)
    with live_server(config, tokenizer=tokenizer) as running:
        yield running


def post(url: str, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny", **body}, timeout=120)


def reference_logprobs(ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 from a plain forward of the same tiny model."""
    with torch.no_grad():
        logits = make_tiny("llama")(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_echo_scores_every_prompt_token_as_a_full_forward(server: tuple[str, Engine]) -> None:
    url, engine = server
    ids = list(engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    body = post(url, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == PROMPT
    assert logprobs["token_logprobs"][0] is None and len(logprobs["token_logprobs"]) == len(ids)
    assert torch.tensor(logprobs["token_logprobs"][1:]) == pytest.approx(reference_logprobs(ids), abs=1e-4)
    assert all(
        max(top.values()) >= lp
        for top, lp in zip(logprobs["top_logprobs"][1:], logprobs["token_logprobs"][1:], strict=True)
    )
    # the same prompt as token ids, with one generated token after it (lm-eval's loglikelihood request)
    by_ids = post(url, {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1}).json()["choices"][0]
    assert by_ids["logprobs"]["token_logprobs"][: len(ids)] == logprobs["token_logprobs"]
    assert len(by_ids["logprobs"]["token_logprobs"]) == len(ids) + 1


def test_a_completion_scores_its_tokens_and_repeats_greedily(server: tuple[str, Engine]) -> None:
    url, _ = server
    done = post(url, {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2, "method": "snapkv", "budget": 0.5}).json()
    choice = done["choices"][0]
    assert done["object"] == "text_completion" and done["usage"]["completion_tokens"] == len(
        choice["logprobs"]["tokens"]
    )
    assert all(
        len(top) == 2 and lp <= 0
        for top, lp in zip(choice["logprobs"]["top_logprobs"], choice["logprobs"]["token_logprobs"], strict=True)
    )
    assert choice["finish_reason"] == "length" and choice["text"]
    again = post(url, {"prompt": PROMPT, "max_tokens": 6, "method": "snapkv", "budget": 0.5}).json()["choices"][0]
    assert again["text"] == choice["text"]  # greedy: the same answer, with or without scores


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "logprobs": 9}, "logprobs"),
        ({"prompt": PROMPT, "stream": True}, "stream"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [5, 10_000]}, "prompt"),
        ({"prompt": PROMPT, "stop": [*"abcdefghijklmnopq"]}, "stop"),
        ({"prompt": PROMPT, "temperature": 3}, "temperature"),
    ],
)
def test_bad_completion_requests_answer_400_naming_the_field(
    server: tuple[str, Engine], body: dict[str, Any], param: str
) -> None:
    response = post(server[0], body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_another_model_is_404(server: tuple[str, Engine]) -> None:
    response = httpx.post(server[0] + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=30)
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_conversation_ids_follow_the_stored_head() -> None:
    tokenizer = chat_tokenizer()
    turns = [("user", "first question?"), ("assistant", "an answer"), ("user", "and then?")]
    head = tokenizer("<user>" + "some document", add_special_tokens=False)["input_ids"]
    whole = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "some document\n\nfirst question?"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "and then?"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert head + conversation_ids(tokenizer, turns) == tokenizer(whole, add_special_tokens=False)["input_ids"]


def test_a_conversation_on_a_stored_context_answers_as_the_whole_prompt(server: tuple[str, Engine]) -> None:
    url, _ = server
    text = document(3, 200)
    context = post(url, {"text": text}, "/v1/contexts").json()
    turns = [
        {"role": "user", "content": "what is the key?"},
        {"role": "assistant", "content": "alpha beta"},
        {"role": "user", "content": "and the value?"},
    ]
    stored = post(url, {"messages": turns, "context_id": context["id"], "max_tokens": 8}, "/v1/chat/completions")
    first = {"role": "user", "content": text + "\n\n" + turns[0]["content"]}
    whole = post(url, {"messages": [first, *turns[1:]], "max_tokens": 8}, "/v1/chat/completions")
    assert stored.status_code == whole.status_code == 200, stored.text
    assert stored.json()["choices"][0]["message"] == whole.json()["choices"][0]["message"]
    assert stored.json()["usage"]["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q?"}],
        [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a"}],
    ],
)
def test_a_conversation_on_a_stored_context_is_checked(server: tuple[str, Engine], messages: list[Any]) -> None:
    url, _ = server
    context = post(url, {"text": document(4, 200)}, "/v1/contexts").json()
    response = post(url, {"messages": messages, "context_id": context["id"]}, "/v1/chat/completions")
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_the_store_folder_is_a_path(tmp_path: Path) -> None:
    assert server_config(tmp_path).store == tmp_path
