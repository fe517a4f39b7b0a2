"""``criticalkv serve --kv-bits 4``: stored contexts and answers kept quantized, live on 127.0.0.1.

Answers equal :func:`criticalkv.generate` with ``kv_bits=4`` on the same inputs, whether the
context is in memory or was spilled and read back, alone or decoded beside other rows; the
memory cap and ``/metrics`` count the quantized bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import criticalkv
from criticalkv import CompressedCache, attach
from criticalkv.cache import CacheSpec
from criticalkv.cache.quantized import KVQuantization
from criticalkv.cli import main
from criticalkv.methods import get_method
from criticalkv.runtime import append_rows, decode_rows, prefill_into, repeat_prompt
from criticalkv.serve import Engine
from criticalkv.serve.compress import compress
from criticalkv.serve.row_memory import answer_reserve, token_bytes
from criticalkv.serve.session import ChatWork
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
)
from tests.helpers.tiny_tokenizer import char_tokenizer
from tests.serve.test_serve import QUESTIONS, ask, create, prompt_reply_and_expected

BITS = 4


@pytest.fixture(scope="module")
def reference() -> tuple[torch.nn.Module, object]:
    return attach(make_tiny("llama")), char_tokenizer()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    config = server_config(tmp_path_factory.mktemp("store"), kv_bits=BITS, memory_cap_bytes=2_000_000, max_batch=4)
    with live_server(config) as running:
        yield running


def expected(reference: tuple[torch.nn.Module, object], text: str, question: str, bits: int = BITS) -> str:
    model, tokenizer = reference
    result = criticalkv.generate(
        model, tokenizer, text, question, method="critical-adakv", budget=BUDGET, mode="question-agnostic",
        window=WINDOW, max_new_tokens=MAX_NEW, kv_bits=bits,
    )  # fmt: skip
    return result.answers[0]


def test_answers_equal_generate_at_4_bits(server: tuple[str, Engine], reference: tuple) -> None:
    url, engine = server
    text = document(1)
    info = create(url, text)
    assert info["kv_bits"] == BITS and httpx.get(f"{url}/v1/contexts/{info['id']}").json()["kv_bits"] == BITS
    model, _ = reference
    full = CompressedCache.for_model(model, "critical-adakv", BUDGET, window=WINDOW)
    ids = torch.tensor([engine.context_ids(text)])
    prefill_into(model, full, ids, torch.ones_like(ids))
    assert info["kv_bytes"] < full.kv_bytes() / 2  # the quantized bytes, not the model dtype's
    answers = {q: expected(reference, text, q) for q in QUESTIONS}
    assert any(a != expected(reference, text, q, bits=16) for q, a in answers.items())  # 4 bits changes answers
    for question, want in answers.items():
        assert ask(url, info["id"], question) == want
        assert ask(url, info["id"], question, stream=True) == want


def test_a_prompt_compressed_for_the_request_is_quantized_too(server: tuple[str, Engine], reference: tuple) -> None:
    reply, want, _ = prompt_reply_and_expected(server[0], reference, kv_bits=BITS)
    assert reply.choices[0].message.content == want


def test_spilled_contexts_reload_quantized_and_answer_the_same(tmp_path: Path, reference: tuple) -> None:
    # a cap of two 4-bit contexts (a 240-token one holds 12,288 bytes here, 73,728 at 16 bits), not three
    with live_server(server_config(tmp_path, kv_bits=BITS, memory_cap_bytes=30_000)) as running:
        spill_and_reload(*running, reference)


def spill_and_reload(url: str, engine: Engine, reference: tuple) -> None:
    texts = [document(20 + i) for i in range(3)]
    infos = [create(url, text) for text in texts]
    spilled = [i for i in infos if not httpx.get(f"{url}/v1/contexts/{i['id']}").json()["in_memory"]]
    assert spilled  # the cap holds two of them
    scrape = httpx.get(url + "/metrics").text
    assert metric(scrape, "criticalkv_context_bytes_in_memory") <= engine.config.memory_cap_bytes
    for info, text in zip(infos, texts, strict=True):  # each read back (4-bit) when its turn comes
        assert ask(url, info["id"], QUESTIONS[0]) == expected(reference, text, QUESTIONS[0])
    _, cache = engine.store.get(spilled[0]["id"])
    assert cache.quantization is not None and cache.quantization.bits == BITS
    assert cache.kv_bytes() == spilled[0]["kv_bytes"]


def test_rows_on_quantized_contexts_decode_together(server: tuple[str, Engine], reference: tuple) -> None:
    url, _ = server
    texts = [document(40), document(41)]
    ids = [create(url, text)["id"] for text in texts]
    jobs = [(k % 2, QUESTIONS[k % 3], k % 2 == 0) for k in range(4)]
    answers: dict[int, str] = {}
    scrapes: list[str] = []
    gate = threading.Barrier(len(jobs))

    def run(n: int, key: int, question: str, stream: bool) -> None:
        gate.wait()
        answers[n] = ask(url, ids[key], question, stream=stream)
        scrapes.append(httpx.get(url + "/metrics").text)

    threads = [threading.Thread(target=run, args=(n, *job)) for n, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for n, (key, question, _) in enumerate(jobs):
        assert answers[n] == expected(reference, texts[key], question), n
    assert metric(scrapes[-1], "criticalkv_decode_rows_max") >= 2  # several 4-bit rows in one step
    for text in scrapes:
        check_row_memory(text)


@pytest.mark.parametrize("on_context", [True, False])
def test_a_quantized_answer_holds_no_more_than_its_reserve(reference: tuple, on_context: bool) -> None:
    model, tokenizer = reference
    storage = KVQuantization(BITS, group_size=16, residual=4)  # small blocks: the tail quantizes as it grows
    spec = CacheSpec(get_method("critical-adakv"), BUDGET, WINDOW, storage=storage)
    repeat = repeat_prompt(tokenizer)
    text = [int(t) for t in tokenizer(document(5), add_special_tokens=False)["input_ids"]]
    question, max_tokens = [5, 6, 7, 8, 9, 10, 11], 60
    stored, logits = compress(model, text, spec, repeat)
    if on_context:
        work = ChatWork(question, "ctx", spec, max_tokens, 0, 0.0)
        cache, base = stored.fork(), stored.kv_bytes()
        logits = append_rows(model, [cache], [question])[0]
    else:
        work = ChatWork(text, None, spec, max_tokens, 0, 0.0)
        cache, base = stored, 0
    reserve = answer_reserve(model, work.spec.storage, work, token_bytes(model))
    held = [cache.kv_bytes() - base]
    for _ in range(max_tokens - 1):
        logits = decode_rows(model, [cache], [int(logits.argmax())])[0]
        held.append(cache.kv_bytes() - base)
    assert cache.compressed_layers[0].storage.tail_used > 0  # blocks were quantized along the way
    assert max(held) <= reserve


def test_the_command_checks_the_storage_options() -> None:
    assert main(["serve", "--kv-group-size", "32", "--port", "1"]) == 2  # without --kv-bits 8 or 4
    assert main(["serve", "--kv-bits", "4", "--kv-group-size", "0", "--port", "1"]) == 2
    assert main(["serve", "--kv-bits", "4", "--kv-residual", "-1", "--port", "1"]) == 2


def test_a_group_size_that_does_not_fit_the_model_is_refused(tmp_path: Path, reference: tuple) -> None:
    model, tokenizer = reference
    with pytest.raises(ValueError, match=r"group size \(kv_group_size\) 12 does not divide the head dimension 16"):
        Engine(model, tokenizer, server_config(tmp_path, kv_bits=4, kv_group_size=12))
