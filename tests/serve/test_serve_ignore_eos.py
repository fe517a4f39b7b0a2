"""``ignore_eos`` on /v1/completions (vLLM's benchmark option): the answer runs to ``max_tokens``
whatever end-of-sequence tokens it meets, and is the answer it would be otherwise up to its end."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from criticalkv.serve import Engine
from tests.helpers.serve_helpers import MAX_NEW, document, live_server, server_config


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    with live_server(server_config(tmp_path_factory.mktemp("store"))) as running:
        yield running


def complete(url: str, **extra: object) -> dict:
    body = {"model": "tiny", "prompt": document(5, 80) + " What is the key?", "max_tokens": MAX_NEW, **extra}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_ignore_eos_runs_the_answer_to_max_tokens(server: tuple[str, Engine]) -> None:
    url, engine = server
    plain = complete(url)
    eos = engine.eos
    engine.eos = set(range(engine.model.config.vocab_size))  # every token ends an answer now
    try:
        ended = complete(url)
        assert ended["usage"]["completion_tokens"] == 0 and ended["choices"][0]["finish_reason"] == "stop"
        kept_going = complete(url, ignore_eos=True)
    finally:
        engine.eos = eos
    assert kept_going["usage"]["completion_tokens"] == MAX_NEW
    assert kept_going["choices"][0]["finish_reason"] == "length"
    assert kept_going["choices"][0]["text"].startswith(plain["choices"][0]["text"])  # equal if it ran to the end
