"""Stop sequences and sampling (temperature, top_p, seed) on the live server, and their parts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from criticalkv.serve import Engine
from criticalkv.serve.sampling import Sampling, TokenChooser, nucleus
from criticalkv.serve.stops import StopText
from tests.helpers.serve_helpers import MAX_NEW, document, live_server, metric, server_config
from tests.serve.test_serve import client, create, expected, reference  # noqa: F401 (a fixture)

QUESTION = "What is the key?"
OFFLOAD = 64  # prompts of at least this many tokens go through the compression thread


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    config = server_config(
        tmp_path_factory.mktemp("store"), max_batch=4, memory_cap_bytes=2_000_000, offload_prompt_tokens=OFFLOAD
    )
    with live_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def context(server: tuple[str, Engine]) -> tuple[str, str]:
    """A stored context's (text, id)."""
    text = document(1)
    return text, create(server[0], text)["id"]


def chat(url: str, context_id: str | None, stream: bool = False, **options: Any) -> tuple[str, str | None, int]:
    """(answer, finish_reason, completion tokens or -1 when streamed) of one request."""
    extra: dict[str, Any] = {"context_id": context_id} if context_id else {}
    content = QUESTION if context_id else document(7, 120) + " " + QUESTION
    for key in ("stop", "seed", "top_p", "temperature"):  # through extra_body: sent as they are
        if key in options:
            extra[key] = options.pop(key)
    messages = [{"role": "user", "content": content}]
    c = client(url)
    max_tokens = options.pop("max_tokens", MAX_NEW)
    if not stream:
        reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, extra_body=extra)
        assert reply.usage is not None
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason, reply.usage.completion_tokens
    parts, finishes = [], []
    for chunk in c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, extra_body=extra, stream=True
    ):
        parts.append(chunk.choices[0].delta.content or "")
        finishes.append(chunk.choices[0].finish_reason)
    assert finishes[-1] is not None and sum(f is not None for f in finishes) == 1
    stops = extra.get("stop") or []
    assert not any(s in part for part in parts for s in ([stops] if isinstance(stops, str) else stops))
    return "".join(parts), finishes[-1], -1


def both(url: str, context_id: str | None, **options: Any) -> tuple[str, str | None, int]:
    """The non-streamed answer, checked equal to the streamed one (and their finish reasons)."""
    text, finish, tokens = chat(url, context_id, **options)
    assert chat(url, context_id, stream=True, **options)[:2] == (text, finish)
    return text, finish, tokens


def test_stop_ends_the_answer_before_the_sequence(server: tuple[str, Engine], context: tuple[str, str]) -> None:
    url, _ = server
    full, finish, tokens = chat(url, context[1])
    assert len(full) >= 6, full  # the tiny model's greedy answer is long enough to cut
    assert both(url, context[1], stop=["\x7fnever"]) == (full, finish, tokens)  # a stop that never occurs
    stop = full[4:6]
    want = full[: full.find(stop)]
    scrape = httpx.get(url + "/metrics").text
    text, reason, used = both(url, context[1], stop=stop)
    assert (text, reason) == (want, "stop") and used < tokens
    assert both(url, context[1], stop=["\x7fnever", stop, full[2:4] + "\x7f"]) == (text, reason, used)
    earlier = full[1:3]
    assert both(url, context[1], stop=[stop, earlier])[:2] == (full[: full.find(earlier)], "stop")
    # the row left the batch at the token that completed the stop: no decode step after it
    after_one = httpx.get(url + "/metrics").text
    assert metric(after_one, "criticalkv_sessions_active") == 0 and metric(after_one, "criticalkv_rows_kv_bytes") == 0
    text2, _, used2 = chat(url, context[1], stop=stop)
    final = httpx.get(url + "/metrics").text
    assert text2 == want and used2 == used

    def grew(name: str) -> float:
        return metric(final, name) - metric(after_one, name)

    assert grew("criticalkv_generated_tokens_total") == used
    assert grew("criticalkv_decode_rows_total") == used - 1  # its first token came from the start step
    assert metric(scrape, "criticalkv_generated_tokens_total") < metric(final, "criticalkv_generated_tokens_total")


def test_stop_on_a_prompt_compressed_on_the_compression_thread(server: tuple[str, Engine]) -> None:
    url, engine = server
    full, _, _ = chat(url, None)
    assert len(full) >= 4
    text, reason, _ = both(url, None, stop=full[2:4])
    assert (text, reason) == (full[: full.find(full[2:4])], "stop")
    assert engine.config.offload_prompt_tokens == OFFLOAD


def test_temperature_zero_equals_generate(server: tuple[str, Engine], context: tuple[str, str], reference) -> None:  # noqa: F811
    url, _ = server
    want = expected(reference, context[0], QUESTION)
    assert both(url, context[1], temperature=0, top_p=0.3, seed=5)[0] == want
    assert both(url, context[1], temperature=0.0)[0] == want


def test_sampled_answers_differ_from_greedy_and_repeat_with_their_seed(
    server: tuple[str, Engine], context: tuple[str, str]
) -> None:
    url, _ = server
    greedy = chat(url, context[1])[0]
    sampled = {seed: both(url, context[1], temperature=2, seed=seed)[0] for seed in range(3)}
    assert any(answer != greedy for answer in sampled.values())  # sampling is not argmax
    assert len(set(sampled.values())) > 1  # the seed matters
    assert chat(url, context[1], temperature=2, seed=1)[0] == sampled[1]
    nucleus = chat(url, context[1], temperature=1.5, top_p=1e-9, seed=4)[0]  # only the argmax is left
    assert nucleus == greedy
    # on the compression thread's path too
    prompt = chat(url, None, temperature=1.5, seed=9)[0]
    assert chat(url, None, stream=True, temperature=1.5, seed=9)[0] == prompt


def test_a_seeded_answer_is_the_same_inside_a_batch(server: tuple[str, Engine], context: tuple[str, str]) -> None:
    url, _ = server
    alone = chat(url, context[1], temperature=1.2, top_p=0.9, seed=11)[0]
    jobs = [dict(temperature=1.2, top_p=0.9, seed=11), dict(temperature=1.0, seed=12), {}, dict(temperature=2, seed=13)]
    answers: dict[int, str] = {}
    for _ in range(4):  # bounded: until the rows shared a decode step (they nearly always do at once)
        before = metric(httpx.get(url + "/metrics").text, "criticalkv_decode_steps_total")
        gate = threading.Barrier(len(jobs))

        def run(n: int, options: dict[str, Any], gate: threading.Barrier = gate) -> None:
            gate.wait()
            answers[n] = chat(url, context[1], stream=n % 2 == 1, **options)[0]

        threads = [threading.Thread(target=run, args=(n, dict(job))) for n, job in enumerate(jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert answers[0] == alone
        scrape = httpx.get(url + "/metrics").text
        rows = metric(scrape, "criticalkv_decode_rows_max")
        if rows >= 2 and metric(scrape, "criticalkv_decode_steps_total") - before < len(jobs) * (MAX_NEW - 1):
            break
    else:
        pytest.fail("the requests never shared a decode step")


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [*"abcdefghijklmnopq"]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
    ],
)
def test_bad_sampling_or_stop_answers_400(
    server: tuple[str, Engine], context: tuple[str, str], options: dict[str, Any], param: str
) -> None:
    url, _ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "context_id": context[1], **options}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


probabilities = st.lists(st.floats(0.001, 1.0), min_size=1, max_size=30).map(
    lambda xs: torch.tensor(xs, dtype=torch.float64) / sum(xs)
)


@settings(max_examples=200, deadline=None)
@given(probs=probabilities, top_p=st.floats(1e-6, 1.0))
def test_top_p_keeps_the_smallest_prefix_reaching_p(probs: torch.Tensor, top_p: float) -> None:
    ids, values = nucleus(probs, top_p)
    assert torch.equal(values, probs[ids])  # each kept token with its probability
    keep = torch.zeros(probs.shape, dtype=torch.bool)
    keep[ids] = True
    assert keep[probs == probs.max()].any()  # the argmax (one of them, if tied) is kept
    kept, dropped = probs[keep], probs[~keep]
    if len(dropped):
        assert kept.min() >= dropped.max()  # a prefix of the sorted probabilities
        assert kept.sum() >= top_p - 1e-12  # reaching p
    assert kept.sum() - kept.min() < top_p + 1e-12  # and the smallest such prefix


def test_sampling_uses_its_own_generator() -> None:
    logits = torch.randn(50)
    torch.manual_seed(0)
    first = [TokenChooser(Sampling(1.0, 1.0, seed=3)).choose(logits) for _ in range(3)]
    torch.manual_seed(1)  # the global RNG changes nothing
    assert [TokenChooser(Sampling(1.0, 1.0, seed=3)).choose(logits) for _ in range(3)] == first
    state = torch.get_rng_state()
    TokenChooser(Sampling(1.0, 0.5)).choose(logits)
    assert torch.equal(torch.get_rng_state(), state)  # and draws leave it alone
    assert TokenChooser(Sampling()).choose(logits) == int(logits.argmax())


alphabet = st.text("ab \n", max_size=30)


@example(text="aa\na", stops=["\n", "a\na"], cuts=[3])  # a stop seen while a longer one, begun earlier, may complete
@settings(max_examples=300, deadline=None)
@given(
    text=alphabet,
    stops=st.lists(st.text("ab \n", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_stop_hold_back_streams_the_whole_answer_and_no_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    found = [i for s in stops if (i := text.find(s)) >= 0]
    want = text[: min(found)] if found else text.rstrip()
    stream = StopText(stops)
    pieces = [stream.update(text[:cut]) for cut in sorted(c for c in cuts if c <= len(text))]
    pieces.append(stream.update(text, final=True))
    assert "".join(pieces) == stream.emitted == want
    assert stream.stopped == bool(found)
    assert not any(s in "".join(pieces) for s in stops)


@pytest.mark.parametrize("top_p", [1.0, 0.75])
def test_draws_follow_the_tempered_nucleus(top_p: float) -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log() * 2  # at temperature 2 the probabilities are ``probs`` again
    chooser = TokenChooser(Sampling(2.0, top_p, seed=0))
    counts = torch.bincount(torch.tensor([chooser.choose(logits) for _ in range(4000)]), minlength=4)
    want = probs if top_p == 1 else torch.tensor([0.5, 0.25, 0.0, 0.0]) / 0.75
    assert torch.allclose(counts / 4000, want, atol=0.03), counts
