"""``criticalkv bench``'s quality column: each row's greedy tokens against the full cache's
(``token_match``), from records and from a run on a tiny model."""

from __future__ import annotations

import pytest
from transformers import PreTrainedModel

from criticalkv.bench import BenchConfig, run_bench
from criticalkv.bench.tables import derived, format_table, token_match
from tests.helpers.tiny_tokenizer import char_tokenizer


def _record(method: str, tokens: list[list[int]] | None, budget: float = 0.2) -> dict[str, object]:
    key = {
        "impl": "criticalkv",
        "method": method,
        "context_tokens": 96,
        "budget": budget,
        "batch_size": len(tokens or [0]),
    }
    times = {"decode_ms_per_token": 10.0, "compress_s": 0.1, "prefill_s": 1.0, "ttft_s": 1.1, "tokens_per_s": 1.0}
    return key | times | {"kv_bytes": 100, "kv_ratio": budget, "greedy_tokens": tokens}


def test_match_is_the_share_of_steps_equal_to_the_full_caches() -> None:
    full = _record("full", [[5, 6, 7, 8], [1, 2, 3, 4]], budget=1.0)
    other = _record("snapkv", [[5, 6, 9, 9], [1, 2, 3, 4]])
    assert token_match(full, other) == pytest.approx(6 / 8)
    assert token_match(full, full) is None  # the reference itself
    assert token_match(None, other) is None and token_match(full, _record("snapkv", None)) is None
    assert token_match(full, _record("snapkv", [[5, 6, 7, 8]])) is None  # another batch size
    rows = derived([full, other, _record("adakv", None)])  # a record written before the column existed
    assert [r["token_match"] for r in rows] == [None, pytest.approx(0.75), None]
    table = format_table([full, other])
    assert "match" in table.splitlines()[0] and " 0.75 " in table


def test_keeping_everything_reproduces_the_full_caches_tokens(tiny_llama: PreTrainedModel) -> None:
    config = BenchConfig(
        context_lengths=[96], methods=["snapkv", "critical-adakv"], budgets=[1.0, 0.25], batch_sizes=[2],
        decode_tokens=6, window=8, kvpress="off",
    )  # fmt: skip
    records = run_bench(config, tiny_llama, char_tokenizer())
    for r in records:
        assert r.greedy_tokens is not None and len(r.greedy_tokens) == 2
        assert all(len(row) == 6 + 2 for row in r.greedy_tokens)  # after the prompt, warm-up, 6 timed steps
    rows = {(r["method"], r["budget"]): r for r in derived([r.to_dict() for r in records])}
    assert rows[("full", 1.0)]["token_match"] is None
    assert rows[("snapkv", 1.0)]["token_match"] == 1.0 and rows[("critical-adakv", 1.0)]["token_match"] == 1.0
    for name in ("snapkv", "critical-adakv"):
        assert 0.0 <= rows[(name, 0.25)]["token_match"] <= 1.0
