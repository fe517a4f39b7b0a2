"""The library's internal marker strings in user text (issue 41, section 3): a document, a
question or a turn quoting ``U+2063 CRITICALKV_SPLIT U+2063`` or the conversation marker is
answered as any other text, never a 500 or a 400 blaming the chat template."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from criticalkv.prompts import encode_pair
from criticalkv.serve import Engine
from tests.helpers.lmeval_tasks import chat_tokenizer
from tests.helpers.serve_helpers import document, live_server, server_config

SPLIT = "\u2063CRITICALKV_SPLIT\u2063"
TURN = "\u2063CRITICALKV_CONVERSATION\u2063"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    with live_server(server_config(tmp_path_factory.mktemp("store")), tokenizer=chat_tokenizer()) as running:
        yield running


def test_a_text_quoting_the_split_marker_keeps_it_verbatim() -> None:
    tokenizer = chat_tokenizer()
    context, question = f"before {SPLIT} after", f"what is {SPLIT}?"
    head, tail = encode_pair(tokenizer, context, question)
    plain_head, plain_tail = encode_pair(tokenizer, "before X after", "what is X?")
    # one token per character: each marker is text like any other, in place of the one-character X
    assert len(head) == len(plain_head) + len(SPLIT) - 1 and len(tail) == len(plain_tail) + len(SPLIT) - 1


def test_markers_in_documents_questions_and_turns_are_answered(server: tuple[str, Engine]) -> None:
    url, _ = server
    text = document(3, 200) + f" {SPLIT} and {TURN} " + document(4, 60)
    created = httpx.post(url + "/v1/contexts", json={"text": text}, timeout=60)
    assert created.status_code == 200, created.text
    context_id = created.json()["id"]
    for messages in (
        [{"role": "user", "content": f"what does {SPLIT} mean?"}],
        [{"role": "user", "content": f"and {TURN}?"}, {"role": "assistant", "content": TURN},
         {"role": "user", "content": f"{SPLIT}{TURN}"}],
    ):  # fmt: skip
        body = {"model": "tiny", "messages": messages, "context_id": context_id, "max_tokens": 3}
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
    whole = {"model": "tiny", "messages": [{"role": "user", "content": text + SPLIT}], "max_tokens": 3}
    assert httpx.post(url + "/v1/chat/completions", json=whole, timeout=60).status_code == 200
