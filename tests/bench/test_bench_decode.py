"""``criticalkv bench --decode-budget``: our cache measured while held at a decode budget, its
records keyed apart from plain ones, and bad input refused before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from criticalkv.bench import BenchConfig, run_bench
from criticalkv.bench.runner import load_records, record_key
from criticalkv.bench.tables import format_table
from criticalkv.cache import DecodeBudget
from criticalkv.cache.quantized import KVQuantization
from criticalkv.cli import main
from tests.helpers.tiny_tokenizer import char_tokenizer


def _config(**changes: object) -> BenchConfig:
    base: dict[str, object] = dict(
        context_lengths=[96],
        methods=["snapkv", "critical-adakv"],
        budgets=[1.0],
        batch_sizes=[2],
        decode_tokens=40,
        window=8,
        kvpress="off",
    )
    base.update(changes)
    return BenchConfig(**base)  # type: ignore[arg-type]


def test_decode_budget_bounds_the_peak_and_is_recorded(tiny_llama: PreTrainedModel) -> None:
    plain = {r.method: r for r in run_bench(_config(), tiny_llama, char_tokenizer())}
    bounded = {r.method: r for r in run_bench(_config(decode=DecodeBudget(16, 8)), tiny_llama, char_tokenizer())}
    assert plain["full"].kv_bytes_peak is not None and plain["full"].kv_bytes_peak > plain["full"].kv_bytes
    assert bounded["full"].decode_budget is None  # the reference keeps everything either way
    for name in ("snapkv", "critical-adakv"):
        b, p = bounded[name], plain[name]
        assert (b.decode_budget, b.decode_interval) == (16, 8)
        assert b.decode_reselections is not None and b.decode_reselections > 0
        assert p.decode_budget is None and p.decode_reselections is None
        # the prompt (budget 1.0: 96 entries per head) is kept to the decode budget, 16 entries per head
        assert b.kv_bytes * 96 == p.kv_bytes * 16
        assert b.kv_bytes_peak is not None and p.kv_bytes_peak is not None
        assert b.kv_bytes_peak < p.kv_bytes_peak
    table = format_table([r.to_dict() for r in [*plain.values(), *bounded.values()]])
    assert "snapkv+d16" in table and "KV peak" in table


def test_decode_records_resume_apart_from_plain_ones(tiny_llama: PreTrainedModel, tmp_path: Path) -> None:
    config = _config(methods=["snapkv"], decode_tokens=3, batch_sizes=[1])
    first = run_bench(config, tiny_llama, char_tokenizer(), out=tmp_path)
    keys = [record_key(r) for r in first]
    assert keys == ["criticalkv|full|96|1.0|1", "criticalkv|snapkv|96|1.0|1"]  # unchanged without the option
    decoded = _config(methods=["snapkv"], decode_tokens=3, batch_sizes=[1], decode=DecodeBudget(16, 8))
    second = run_bench(decoded, tiny_llama, char_tokenizer(), out=tmp_path)
    assert [record_key(r) for r in second] == ["criticalkv|snapkv|96|1.0|1|decode=16/8"]  # full is shared
    assert run_bench(decoded, tiny_llama, char_tokenizer(), out=tmp_path) == []
    assert run_bench(config, tiny_llama, char_tokenizer(), out=tmp_path) == []
    assert len(load_records(tmp_path / "records.jsonl")) == 3


def test_old_records_without_decode_fields_keep_their_key() -> None:
    old = {"impl": "criticalkv", "method": "snapkv", "context_tokens": 96, "budget": 0.25, "batch_size": 1}
    assert record_key(old) == "criticalkv|snapkv|96|0.25|1"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"decode": DecodeBudget(4)}, "below the observation window"),
        ({"decode": DecodeBudget(16, 0)}, "decode_interval must be a positive"),
        ({"decode": DecodeBudget(16), "methods": ["expected-attention"]}, "cannot re-select while decoding"),
        ({"decode": DecodeBudget(16), "storage": KVQuantization(4, residual=32)}, "longer than the decode budget"),
        ({"decode": DecodeBudget(16.5)}, "token count per KV head"),  # type: ignore[arg-type]
    ],
)
def test_config_rejects_bad_decode_input(changes: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        _config(**changes)


def test_cli_decode_budget_records(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", str(tiny_folder), "--context-lengths", "96", "--methods", "snapkv", "--budgets", "1.0"]
    argv += ["--decode-tokens", "30", "--window", "8", "--decode-budget", "16", "--decode-interval", "8", "--json"]
    assert main([*argv, "--kvpress", "off"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["impl"], r["method"], r["decode_budget"]) for r in records] == [
        ("criticalkv", "full", None),
        ("criticalkv", "snapkv", 16),
    ]
    assert records[1]["decode_interval"] == 8 and records[1]["kv_bytes_peak"] < records[0]["kv_bytes_peak"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--decode-budget", "4"], "--decode-budget 4 is below the observation window"),
        (["--decode-budget", "16", "--decode-interval", "0"], "--decode-interval must be a positive"),
        (["--decode-budget", "16", "--methods", "expected-attention"], "cannot re-select while decoding"),
        (["--decode-budget", "16", "--kv-bits", "4", "--kv-residual", "32"], "longer than the decode budget"),
    ],
)
def test_cli_rejects_bad_decode_input_before_loading(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--model", "/nonexistent/model", "--context-lengths", "96", "--window", "8", *extra]
    assert main(argv) == 2  # refused before the (missing) model is looked for
    assert message in capsys.readouterr().err
