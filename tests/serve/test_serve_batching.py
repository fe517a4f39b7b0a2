"""The live server decodes requests that arrive together as rows of one batch, capped by max_batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from criticalkv import attach
from criticalkv.serve import Engine
from criticalkv.serve import engine as engine_module
from tests.conftest import make_tiny
from tests.helpers.serve_helpers import (
    MAX_NEW,
    check_row_memory,
    document,
    live_server,
    metric,
    server_config,
    wait_until,
)
from tests.helpers.tiny_tokenizer import char_tokenizer
from tests.serve.test_serve import QUESTIONS, ask, create, expected

MAX_BATCH = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    config = server_config(tmp_path_factory.mktemp("store"), max_batch=MAX_BATCH, memory_cap_bytes=2_000_000)
    with live_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def reference() -> tuple[object, object]:
    return attach(make_tiny("llama")), char_tokenizer()


def hang_up_after_first_event(url: str, context_id: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "q?"}], "context_id": context_id,
            "stream": True, "max_tokens": MAX_NEW}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())


def burst(url: str, ids: list[str], jobs: list[tuple[int, str, bool]], leaver: bool = True) -> dict[int, str]:
    """Every job at once (and, with ``leaver``, a client that hangs up after its first event); the
    answers by job."""
    answers: dict[int, str] = {}
    gate = threading.Barrier(len(jobs) + int(leaver))

    def run(n: int, key: int, question: str, stream: bool) -> None:
        gate.wait()
        answers[n] = ask(url, ids[key], question, stream=stream)

    def leave() -> None:
        gate.wait()
        hang_up_after_first_event(url, ids[0])

    threads = [threading.Thread(target=run, args=(n, *job)) for n, job in enumerate(jobs)]
    if leaver:
        threads.append(threading.Thread(target=leave))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return answers


def test_requests_that_arrive_together_decode_together(server: tuple[str, Engine], reference: object) -> None:
    url, engine = server
    texts = [document(40 + i, 150 + 30 * i) for i in range(3)]  # different contexts, different lengths
    ids = [create(url, text)["id"] for text in texts]
    jobs = [(i % 3, QUESTIONS[i % len(QUESTIONS)], i % 2 == 0) for i in range(7)]
    want = {(k, q): expected(reference, texts[k], q) for k, q, _ in jobs}
    for _ in range(4):  # bounded: until one burst overlapped (it nearly always does at once)
        answers = burst(url, ids, jobs)
        assert {n: answers.get(n) for n in range(len(jobs))} == {n: want[k, q] for n, (k, q, _) in enumerate(jobs)}
        rows_max = metric(httpx.get(url + "/metrics").text, "criticalkv_decode_rows_max")
        assert rows_max <= MAX_BATCH  # never more rows than the cap
        if rows_max >= 2:
            break
    assert rows_max >= 2  # several answers shared a decode step
    assert wait_until(lambda: engine.active() == 0 and engine.admitted() == 0)  # the client that left is dropped


def test_answers_that_arrive_together_start_in_one_forward(server: tuple[str, Engine], reference: object) -> None:
    """Batched starts on a live server: the questions of requests admitted in the same step are
    appended together (different contexts and question lengths), the answers still equal
    ``criticalkv.generate``, and at every scrape the per-row gauges add up within the cap."""
    url, engine = server
    texts = [document(80 + i, 120 + 40 * i) for i in range(3)]
    ids = [create(url, text)["id"] for text in texts]
    jobs = [(i % 3, QUESTIONS[(i + i // 3) % len(QUESTIONS)], i % 2 == 1) for i in range(6)]
    want = {(k, q): expected(reference, texts[k], q) for k, q, _ in jobs}
    scraped: list[str] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            scraped.append(httpx.get(url + "/metrics").text)
            time.sleep(0.005)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    engine.metrics.start_rows_max = 0
    try:
        for _ in range(4):  # bounded: until the arrivals of one burst started together
            answers = burst(url, ids, jobs, leaver=False)
            assert answers == {n: want[k, q] for n, (k, q, _) in enumerate(jobs)}
            if engine.metrics.start_rows_max >= 2 and any(check_row_memory(t)[0] >= 1 for t in list(scraped)):
                break
    finally:
        stop.set()
        scraper.join()
    scrapes = [check_row_memory(text) for text in scraped]
    assert engine.metrics.start_rows_max >= 2  # several questions were appended in one forward
    assert engine.metrics.start_rows_max <= MAX_BATCH
    assert scrapes and max(n for n, _ in scrapes) <= MAX_BATCH
    assert any(n >= 1 for n, _ in scrapes)  # the scrapes saw rows being decoded


def test_rows_that_do_not_fit_the_memory_cap_wait(server: tuple[str, Engine], reference: object) -> None:
    url, engine = server
    texts = [document(60 + i, 200) for i in range(3)]
    infos = [create(url, text) for text in texts]
    jobs = [(i, QUESTIONS[i], False) for i in range(3)]  # three distinct contexts at once
    cap = engine.config.memory_cap_bytes
    engine.config.memory_cap_bytes = int(1.5 * max(info["kv_bytes"] for info in infos))  # room for one row
    engine.metrics.decode_rows_max = 0
    try:
        answers = burst(url, [info["id"] for info in infos], jobs, leaver=False)
    finally:
        engine.config.memory_cap_bytes = cap
    assert answers == {i: expected(reference, texts[i], QUESTIONS[i]) for i in range(3)}
    assert engine.metrics.decode_rows_max == 1  # each waited for the one before to leave


def test_max_batch_must_be_positive(tmp_path: Path) -> None:
    from criticalkv.cli import main

    assert main(["serve", "--max-batch", "0", "--store", str(tmp_path)]) == 2


def test_a_document_being_compressed_does_not_stall_the_rows(
    server: tuple[str, Engine], reference: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A posted document is compressed on its own thread: held there (until released), it lets an
    answer on a stored context decode to its end; the document is stored once released."""
    url, engine = server
    text = document(60)
    context_id = create(url, text)["id"]
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    compress = engine_module.compress  # what the engine compresses a posted document with

    def held(*args: object) -> object:
        entered.set()
        release.wait(timeout=120)  # bounded: a worker that waited for it would answer after this
        try:
            return compress(*args)
        finally:
            returned.set()

    monkeypatch.setattr(engine_module, "compress", held)
    posted: dict[str, httpx.Response] = {}
    poster = threading.Thread(
        target=lambda: posted.update(r=httpx.post(url + "/v1/contexts", json={"text": document(61)}, timeout=180))
    )
    poster.start()
    try:
        assert entered.wait(timeout=60)  # the compression has started and is held
        assert metric(httpx.get(url + "/metrics").text, "criticalkv_queue_depth") >= 1
        assert ask(url, context_id, QUESTIONS[0], stream=True) == expected(reference, text, QUESTIONS[0])
        assert not returned.is_set()  # answered while the document's compression was still held
    finally:
        release.set()
        poster.join(timeout=180)
    assert posted["r"].status_code == 200 and engine.store.has(posted["r"].json()["id"])
