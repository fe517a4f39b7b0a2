"""Long prompts that arrive together are compressed together (one left-padded prefill, then split
into a cache per answer) and their answers decode as the rows of one batch.

Live: N concurrent chats without a context each answer what ``model.generate`` answers with its
prompt compressed alone, ``/metrics`` shows one prompt compression of N prompts and decode steps
of N rows. Unit: which queued prompts share a prefill (same method, budget and window; the token
budget and the row limit; arrival order), without a model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from criticalkv import attach
from criticalkv.serve import Engine
from criticalkv.serve.prompt_queue import PromptQueue
from tests.conftest import make_tiny
from tests.helpers.serve_helpers import MAX_NEW, document, live_server, metric, server_config
from tests.helpers.tiny_tokenizer import char_tokenizer
from tests.serve.test_serve import client
from tests.serve.test_serve_prompts import prompt_expected

N = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    config = server_config(
        tmp_path_factory.mktemp("store"),
        memory_cap_bytes=4_000_000,
        offload_prompt_tokens=100,
        prefill_gather_s=1.0,  # generous: the N requests of a loaded CI machine all arrive within it
    )
    with live_server(config) as running:
        yield running


def completion(url: str, content: str) -> Any:
    messages = [{"role": "user", "content": content}]
    return client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW)


def test_concurrent_prompts_are_compressed_in_one_batch_and_decoded_as_rows(server: tuple[str, Engine]) -> None:
    url, _ = server
    reference = attach(make_tiny("llama")), char_tokenizer()
    prompts = [document(90 + i, 130 + 17 * i) + " What is the key?" for i in range(N)]  # lengths differ
    replies: dict[int, Any] = {}
    start = threading.Barrier(N)

    def send(i: int) -> None:
        start.wait()
        replies[i] = completion(url, prompts[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(N)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(replies) == list(range(N))
    for i, prompt in enumerate(prompts):
        assert replies[i].choices[0].message.content == prompt_expected(reference, prompt)
    text = httpx.get(url + "/metrics").text
    assert metric(text, "criticalkv_prompt_batches_total") == 1
    assert metric(text, "criticalkv_prompt_batch_rows_max") == N
    decoding = sum(1 for r in replies.values() if r.usage.completion_tokens >= 1)  # a first-token EOS leaves at once
    assert decoding >= 2, "pick prompts whose answers decode (the test shows rows decoded together)"
    assert metric(text, "criticalkv_decode_rows_max") == decoding


@dataclass
class FakeWork:
    prompt_ids: list[int]


@dataclass(eq=False)
class FakeSession:
    """What the batching reads of a session: its prompt and its batch key."""

    work: FakeWork
    key: tuple[str, float, int] | None
    compressing: bool = False

    def batch_key(self) -> tuple[str, float, int] | None:
        return self.key


def queued(sessions: list[FakeSession], batch_tokens: int, max_rows: int) -> list[list[int]]:
    """The batches (as indices into ``sessions``) the compression jobs take, in order."""
    prompts = PromptQueue(batch_tokens, max_rows)
    for session in sessions:
        prompts.put(session)  # type: ignore[arg-type]
    batches = []
    while batch := prompts.take_batch():
        batches.append([next(i for i, s in enumerate(sessions) if s is taken) for taken in batch])
    return batches


def session(tokens: int, key: tuple[str, float, int] | None = ("snapkv", 0.2, 64)) -> FakeSession:
    return FakeSession(FakeWork(list(range(tokens))), key)


def test_which_queued_prompts_share_a_prefill() -> None:
    other = ("critical-snapkv", 0.2, 64)
    sessions = [session(500), session(300), session(400, other), session(200), session(100, None), session(450)]
    # the oldest first; beside it the queued prompts of its key in order, while they fit
    assert queued(sessions, batch_tokens=10_000, max_rows=8) == [[0, 1, 3, 5], [2], [4]]
    # 500 + 300 padded to 2 x 500 fits 1,000 tokens; a third row would make 1,500
    assert queued(sessions, batch_tokens=1_000, max_rows=8) == [[0, 1], [2], [3, 5], [4]]
    assert queued(sessions, batch_tokens=10_000, max_rows=2) == [[0, 1], [2], [3, 5], [4]]
    alone = [session(100, None), session(100, None)]  # no key (quantized storage, KVzip): one each
    assert queued(alone, batch_tokens=10_000, max_rows=8) == [[0], [1]]
