"""Continuous batching: separate compressed caches decoded as the rows of one batch.

Oracle: a batched step gives each row the logits of a batch-1 step on its cache alone.
Property: under any arrival / departure schedule, each row's greedy answer equals
``criticalkv.generate`` on its own inputs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import criticalkv
from criticalkv import CompressedCache, attach
from criticalkv.cache.batch import RowsCache
from criticalkv.prompts import encode_pair
from criticalkv.runtime import append_tokens, decode_answers, decode_rows, eos_ids, prefill_into
from tests.conftest import make_tiny
from tests.helpers.serve_helpers import document
from tests.helpers.tiny_tokenizer import char_tokenizer

MODEL = attach(make_tiny("llama"))
TOKENIZER = char_tokenizer()
EOS = eos_ids(MODEL, TOKENIZER)
WINDOW = 8
MAX_NEW = 7
#: (context, question, mode, method, budget): lengths, modes, methods and budgets all differ
INPUTS = [
    (document(1, 60), "What is the key?", "question-agnostic", "critical-adakv", 0.4),
    (document(2, 130), "Name a value.", "question-agnostic", "snapkv", 0.3),
    (document(3, 95), "Which word comes first?", "question-aware", "critical-adakv", 0.5),
    (document(4, 75), "Is it a needle?", "question-aware", "pyramidkv", 0.25),
    (document(2, 130), "What is the key?", "question-agnostic", "snapkv", 0.3),
]


def start(index: int) -> tuple[CompressedCache, int]:
    """A row's own cache and first token, as the server starts an answer (batch 1)."""
    context, question, mode, method, budget = INPUTS[index]
    ctx, qst = encode_pair(TOKENIZER, context, question)
    cache = CompressedCache.for_model(MODEL, method, budget, window=WINDOW)
    if mode == "question-aware":
        ids = torch.tensor([ctx + qst])
        return cache, int(prefill_into(MODEL, cache, ids, torch.ones_like(ids))[0].argmax())
    ids = torch.tensor([ctx])
    prefill_into(MODEL, cache, ids, torch.ones_like(ids))
    fork = cache.fork()
    out, _ = append_tokens(MODEL, fork, torch.ones_like(ids), torch.tensor([qst]))
    return fork, int(out.logits[0, -1].argmax())


@functools.cache
def expected(index: int, max_new: int) -> str:
    context, question, mode, method, budget = INPUTS[index]
    result = criticalkv.generate(
        MODEL, TOKENIZER, context, question, method=method, budget=budget, mode=mode, window=WINDOW,
        max_new_tokens=max_new,
    )  # fmt: skip
    return result.answers[0]


def test_a_batched_step_gives_each_row_its_batch_1_logits() -> None:
    rows = [start(i) for i in range(len(INPUTS))]
    alone = [start(i) for i in range(len(INPUTS))]
    for _ in range(3):
        batched = decode_rows(MODEL, [c for c, _ in rows], [t for _, t in rows])
        for r, (cache, token) in enumerate(alone):
            length = cache.get_seq_length()
            out, _ = append_tokens(MODEL, cache, torch.ones(1, length, dtype=torch.long), torch.tensor([[token]]))
            torch.testing.assert_close(batched[r], out.logits[0, -1], rtol=1e-4, atol=1e-5)
            assert rows[r][0].get_seq_length() == cache.get_seq_length() == length + 1
        rows = [(c, int(batched[r].argmax())) for r, (c, _) in enumerate(rows)]
        alone = [(c, t) for (c, _), (_, t) in zip(alone, rows, strict=True)]


@dataclass
class Row:
    index: int
    max_new: int
    leave_after: int | None
    cache: CompressedCache | None = None
    tokens: list[int] = field(default_factory=list)
    done: bool = False

    def take(self, token: int) -> None:
        self.tokens.append(token)
        self.done = token in EOS or len(self.tokens) >= self.max_new


REQUEST = st.tuples(
    st.integers(0, len(INPUTS) - 1),  # which inputs
    st.integers(0, 6),  # the decode step it arrives before
    st.integers(1, MAX_NEW),  # max_new_tokens
    st.one_of(st.none(), st.integers(1, 4)),  # its client leaves after this many tokens
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(REQUEST, min_size=1, max_size=6))
def test_each_row_answers_as_alone_whatever_joins_or_leaves(schedule: list[tuple[int, int, int, int | None]]) -> None:
    waiting = sorted(
        [(arrive, Row(index, max_new, leave)) for index, arrive, max_new, leave in schedule], key=lambda p: p[0]
    )
    rows: list[Row] = []
    live: list[Row] = []
    step = 0
    while waiting or live:
        while waiting and waiting[0][0] <= step:  # joins, between two steps
            row = waiting.pop(0)[1]
            row.cache, first = start(row.index)
            row.take(first)
            rows.append(row)
            live.append(row)
        live = [r for r in live if not r.done and (r.leave_after is None or len(r.tokens) < r.leave_after)]
        if live:
            logits = decode_rows(MODEL, [r.cache for r in live], [r.tokens[-1] for r in live])  # type: ignore[misc]
            for row, row_logits in zip(live, logits, strict=True):
                row.take(int(row_logits.argmax()))
        step += 1
    for row in rows:
        if row.leave_after is None or row.done:
            answer, _ = decode_answers(TOKENIZER, torch.tensor([row.tokens]), EOS)
            assert answer[0] == expected(row.index, row.max_new), (row.index, row.max_new)


def test_rows_are_checked() -> None:
    cache, token = start(0)
    with pytest.raises(ValueError, match="one token per cache"):
        decode_rows(MODEL, [cache], [token, token])
    with pytest.raises(ValueError, match="at least one cache"):
        RowsCache([])
    with pytest.raises(ValueError, match="prefill it first"):
        RowsCache([CompressedCache.for_model(MODEL, "snapkv", 0.5, window=WINDOW)])
    with pytest.raises(TypeError, match="not a CompressedCache"):
        RowsCache([cache, object()])  # type: ignore[list-item]
    two = CompressedCache.for_model(MODEL, "snapkv", 0.5, window=WINDOW)
    ids = torch.randint(5, 50, (2, 20))
    prefill_into(MODEL, two, ids, torch.ones_like(ids))
    with pytest.raises(ValueError, match="exactly one row"):
        RowsCache([two])
