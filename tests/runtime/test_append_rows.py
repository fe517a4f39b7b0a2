"""Batched starts: the questions of answers that begin together appended as the rows of one forward.

Oracle: each row's first-token logits equal a batch-1 ``append_tokens`` on its own fork, and its
cache afterwards decodes like the batch-1 one. Property: under any arrival schedule, with the
rows that arrive before the same step started together, every greedy answer equals
``criticalkv.generate`` on its own inputs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from criticalkv import CompressedCache
from criticalkv.prompts import encode_pair
from criticalkv.runtime import append_rows, append_tokens, decode_answers, decode_rows, prefill_into
from tests.runtime.test_decode_rows import EOS, INPUTS, MAX_NEW, MODEL, TOKENIZER, WINDOW, Row, expected, start

#: the question-agnostic inputs: a stored context's fork, then the question
AGNOSTIC = [i for i, (_, _, mode, _, _) in enumerate(INPUTS) if mode == "question-agnostic"]


def fork_and_question(index: int) -> tuple[CompressedCache, list[int]]:
    """A fork of input ``index``'s compressed context and its question's ids (not yet appended)."""
    context, question, _, method, budget = INPUTS[index]
    ctx, qst = encode_pair(TOKENIZER, context, question)
    cache = CompressedCache.for_model(MODEL, method, budget, window=WINDOW)
    ids = torch.tensor([ctx])
    prefill_into(MODEL, cache, ids, torch.ones_like(ids))
    return cache.fork(), qst


def start_together(indices: list[int]) -> list[tuple[CompressedCache, int]]:
    """Rows started as the server starts arrivals of one step: batched question appends for the
    stored-context rows, a batch-1 prefill for the question-aware ones."""
    started: dict[int, tuple[CompressedCache, int]] = {}
    agnostic = [n for n, i in enumerate(indices) if i in AGNOSTIC]
    if agnostic:
        pairs = [fork_and_question(indices[n]) for n in agnostic]
        logits = append_rows(MODEL, [c for c, _ in pairs], [q for _, q in pairs])
        for n, (cache, _), row in zip(agnostic, pairs, logits, strict=True):
            started[n] = cache, int(row.argmax())
    for n, i in enumerate(indices):
        if n not in started:
            started[n] = start(i)
    return [started[n] for n in range(len(indices))]


def test_batched_question_appends_give_each_row_its_batch_1_logits() -> None:
    indices = [AGNOSTIC[k % len(AGNOSTIC)] for k in range(5)]  # repeats: several forks of one context
    pairs = [fork_and_question(i) for i in indices]
    assert len({len(q) for _, q in pairs}) > 1  # the questions differ in length: padding is exercised
    batched = append_rows(MODEL, [c for c, _ in pairs], [q for _, q in pairs])
    for r, i in enumerate(indices):
        cache, question = fork_and_question(i)
        length = cache.get_seq_length()
        out, _ = append_tokens(MODEL, cache, torch.ones(1, length, dtype=torch.long), torch.tensor([question]))
        torch.testing.assert_close(batched[r], out.logits[0, -1], rtol=1e-4, atol=1e-5)
        row = pairs[r][0]
        assert row.get_seq_length() == cache.get_seq_length() == length + len(question)
        assert row.kv_bytes() == cache.kv_bytes()  # the padding never entered the row's cache
        token = int(out.logits[0, -1].argmax())
        step = decode_rows(MODEL, [row], [token])[0]  # and the rows decode on as the batch-1 cache does
        out, _ = append_tokens(MODEL, cache, torch.ones(1, cache.get_seq_length(), dtype=torch.long),
                               torch.tensor([[token]]))  # fmt: skip
        torch.testing.assert_close(step, out.logits[0, -1], rtol=1e-4, atol=1e-5)


REQUEST = st.tuples(
    st.integers(0, len(INPUTS) - 1),  # which inputs
    st.integers(0, 4),  # the decode step it arrives before
    st.integers(1, MAX_NEW),  # max_new_tokens
)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(REQUEST, min_size=1, max_size=6))
def test_rows_started_together_answer_as_generate(schedule: list[tuple[int, int, int]]) -> None:
    waiting = sorted([(arrive, Row(index, max_new, None)) for index, arrive, max_new in schedule], key=lambda p: p[0])
    rows: list[Row] = []
    live: list[Row] = []
    step = 0
    while waiting or live:
        arrivals = []
        while waiting and waiting[0][0] <= step:  # every arrival of this step starts in one forward
            arrivals.append(waiting.pop(0)[1])
        for row, (cache, first) in zip(arrivals, start_together([r.index for r in arrivals]), strict=True):
            row.cache = cache
            row.take(first)
            rows.append(row)
            live.append(row)
        live = [r for r in live if not r.done]
        if live:
            logits = decode_rows(MODEL, [r.cache for r in live], [r.tokens[-1] for r in live])  # type: ignore[misc]
            for row, row_logits in zip(live, logits, strict=True):
                row.take(int(row_logits.argmax()))
        step += 1
    for row in rows:
        answer, _ = decode_answers(TOKENIZER, torch.tensor([row.tokens]), EOS)
        assert answer[0] == expected(row.index, row.max_new), (row.index, row.max_new)


def test_appended_rows_are_checked() -> None:
    cache, question = fork_and_question(AGNOSTIC[0])
    with pytest.raises(ValueError, match="one list per cache"):
        append_rows(MODEL, [cache], [question, question])
    with pytest.raises(ValueError, match="at least one token"):
        append_rows(MODEL, [cache], [[]])
    with pytest.raises(ValueError, match="one length of at least 1"):
        from criticalkv.cache.batch import RowsCache

        RowsCache([cache], [1, 2])
