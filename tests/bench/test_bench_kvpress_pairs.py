"""``criticalkv bench`` beside kvpress under a decode budget (``DecodingPress``) and with quantized
storage (transformers' quanto ``QuantizedCache``); skipped where kvpress is not importable
(``make test-kvpress`` runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from criticalkv.bench import BenchConfig, run_bench
from criticalkv.bench.kvpress_impl import import_kvpress
from criticalkv.bench.kvpress_quantized import pair_unavailable, quanto_unavailable
from criticalkv.bench.record import BenchRecord
from criticalkv.bench.tables import derived, format_table
from criticalkv.cache import DecodeBudget
from criticalkv.cache.quantized import KVQuantization
from criticalkv.cli import main
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer

pytestmark = pytest.mark.skipif(import_kvpress() is None, reason="kvpress is not installed (make test-kvpress)")

BUDGET, INTERVAL, WINDOW = 16, 8, 4


def _entry_bytes(model: PreTrainedModel) -> int:
    """Bytes of one entry of every layer (a key and a value per KV head, float32)."""
    config = model.config
    return 2 * config.num_key_value_heads * config.head_dim * 4 * config.num_hidden_layers


def _bits(record: BenchRecord) -> int | None:
    """The bits a record's entries were stored in as its JSON line spells them (``None``: unquantized)."""
    return record.to_dict()["kv_bits"]


def _config(**changes: object) -> BenchConfig:
    base: dict[str, object] = dict(
        context_lengths=[96],
        methods=["snapkv", "knorm", "streamingllm", "adakv"],
        budgets=[0.25],
        batch_sizes=[2],
        decode_tokens=30,
        window=WINDOW,
        kvpress="on",
        decode=DecodeBudget(BUDGET, INTERVAL),
    )
    base.update(changes)
    return BenchConfig(**base)  # type: ignore[arg-type]


def test_decoding_press_beside_our_decode_budget(tiny_llama: PreTrainedModel) -> None:
    notes: list[str] = []
    records = run_bench(_config(), tiny_llama, char_tokenizer(), kvpress_model=make_tiny("llama"), notes=notes)
    kvpress = {r.method: r for r in records if r.impl == "kvpress"}
    assert sorted(kvpress) == ["knorm", "snapkv", "streamingllm"]  # uniform scorers only
    entry = 2 * _entry_bytes(tiny_llama)  # batch 2
    for r in kvpress.values():
        assert (r.decode_budget, r.decode_interval) == (BUDGET, INTERVAL)
        assert r.kv_bytes == 24 * entry  # the prompt cut to 0.25 x 96
        assert r.kv_bytes_final is not None and r.kv_bytes_peak is not None
        assert r.kv_bytes_final <= (BUDGET + INTERVAL - 1) * entry  # cut back every INTERVAL steps
        assert r.kv_bytes_peak >= max(r.kv_bytes, r.kv_bytes_final)
        assert r.decode_reselections == 30 // INTERVAL * tiny_llama.config.num_hidden_layers
        assert r.press is not None and r.press.startswith("Decoding(")
    assert kvpress["snapkv"].press == "Decoding(SnapKV)"
    rows = {(r["impl"], r["method"]): r for r in derived([r.to_dict() for r in records])}
    ours = rows[("criticalkv", "snapkv")]
    want = kvpress["snapkv"].decode_ms_per_token / ours["decode_ms_per_token"]
    assert ours["decode_speedup_vs_kvpress"] == pytest.approx(want)
    assert ours["kvpress_pair"] == "Decoding(SnapKV)"
    assert rows[("criticalkv", "adakv")]["kvpress_pair"] == "none"
    assert rows[("criticalkv", "adakv")]["decode_speedup_vs_kvpress"] is None
    assert any(n.startswith("adakv: kvpress has no DecodingPress counterpart") for n in notes)
    assert "Decoding(StreamingLLM)" in format_table([r.to_dict() for r in records], notes)


@pytest.mark.skipif(pair_unavailable(4) is None, reason="a QuantizedCache backend (quanto or hqq) imports here")
def test_without_quanto_the_quantized_pair_is_skipped_with_its_reason(tiny_llama: PreTrainedModel) -> None:
    notes: list[str] = []
    config = _config(methods=["snapkv"], decode=None, storage=KVQuantization(4, 8), decode_tokens=2)
    records = run_bench(config, tiny_llama, char_tokenizer(), kvpress_model=make_tiny("llama"), notes=notes)
    assert [(r.impl, _bits(r)) for r in records] == [
        ("criticalkv", None),
        ("criticalkv", None),
        ("kvpress", None),
        ("criticalkv", 4),
    ]
    assert notes == [f"kvpress on a quantized cache not measured: {pair_unavailable(4)}"]
    row = next(r for r in derived([r.to_dict() for r in records]) if r["kv_bits"] == 4)
    assert row["kvpress_pair"] == "not run" and row["decode_speedup_vs_kvpress"] is None


@pytest.mark.skipif(quanto_unavailable(4) is not None, reason="optimum-quanto does not import here")
def test_kvpress_on_a_quanto_cache_beside_ours_quantized(tiny_llama: PreTrainedModel) -> None:
    config = _config(methods=["snapkv"], decode=None, storage=KVQuantization(4, 8), decode_tokens=2)
    records = run_bench(config, tiny_llama, char_tokenizer(), kvpress_model=make_tiny("llama"))
    by = {(r.impl, r.method, _bits(r)): r for r in records}
    quanto, plain = by[("kvpress", "snapkv", 4)], by[("kvpress", "snapkv", None)]
    assert quanto.press == "SnapKV+quanto4" and quanto.storage == KVQuantization(4, 8)
    assert quanto.kv_bytes < plain.kv_bytes
    assert plain.bits_per_element == 32.0  # float32 DynamicCache
    assert quanto.bits_per_element == pytest.approx(4 + 2 * 32 / 8)  # a float32 scale and shift per group of 8
    row = next(r for r in derived([r.to_dict() for r in records]) if r["impl"] == "criticalkv" and r["kv_bits"])
    assert row["kvpress_pair"] == "SnapKV+quanto4" and row["decode_speedup_vs_kvpress"] is not None


@pytest.mark.skipif(
    quanto_unavailable(4) is None or pair_unavailable(4) is not None, reason="quanto imports here, or hqq does not"
)
def test_kvpress_on_an_hqq_cache_where_quanto_is_absent(tiny_llama: PreTrainedModel) -> None:
    config = _config(methods=["snapkv"], decode=None, storage=KVQuantization(4, 8), decode_tokens=2)
    records = run_bench(config, tiny_llama, char_tokenizer(), kvpress_model=make_tiny("llama"))
    by = {(r.impl, r.method, _bits(r)): r for r in records}
    hqq, plain = by[("kvpress", "snapkv", 4)], by[("kvpress", "snapkv", None)]
    assert hqq.press == "SnapKV+hqq4" and hqq.storage == KVQuantization(4, 8)
    assert hqq.kv_bytes < plain.kv_bytes


@pytest.mark.skipif(pair_unavailable(4) is not None, reason="no QuantizedCache backend (quanto or hqq) imports here")
def test_a_masking_press_on_a_quantized_cache_holds_every_entry(tiny_llama: PreTrainedModel) -> None:
    """kvpress's AdaKV masks: on transformers' QuantizedCache it still holds all 96 entries (at 4
    bits), ours holds the kept quarter; both count the same bits per entry held."""
    config = _config(methods=["adakv"], decode=None, storage=KVQuantization(4, 8), decode_tokens=2)
    records = run_bench(config, tiny_llama, char_tokenizer(), kvpress_model=make_tiny("llama"))
    by = {(r.impl, _bits(r)): r for r in records if r.method == "adakv"}
    theirs, theirs_plain, ours = by[("kvpress", 4)], by[("kvpress", None)], by[("criticalkv", 4)]
    assert theirs_plain.kv_bytes == theirs_plain.kv_bytes_full and theirs_plain.bits_per_element == 32.0
    assert theirs.bits_per_element is not None and theirs.bits_per_element < 16
    held = 8 * theirs.kv_bytes / theirs.bits_per_element  # elements held (keys and values)
    assert held == pytest.approx(8 * theirs.kv_bytes_full / 32)  # every entry of the prompt
    assert ours.kv_bytes < 0.5 * theirs.kv_bytes  # ours evicted three quarters before quantizing
    assert theirs.greedy_tokens is not None and [len(row) for row in theirs.greedy_tokens] == [2 + 2] * 2


def test_cli_decode_budget_beside_kvpress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "tiny"
    make_tiny("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    argv = [
        "bench",
        "--model",
        str(folder),
        "--context-lengths",
        "96",
        "--methods",
        "snapkv,adakv",
        "--budgets",
        "0.25",
    ]
    argv += ["--decode-tokens", "20", "--window", str(WINDOW), "--decode-budget", str(BUDGET)]
    argv += ["--decode-interval", str(INTERVAL), "--kvpress", "on", "--json", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["impl"], r["method"], r["decode_budget"]) for r in records] == [
        ("criticalkv", "full", None),
        ("criticalkv", "snapkv", BUDGET),
        ("kvpress", "snapkv", BUDGET),
        ("criticalkv", "adakv", BUDGET),
    ]
    table = (tmp_path / "out" / "table.txt").read_text()
    assert "Decoding(SnapKV)" in table and "note: adakv: kvpress has no DecodingPress counterpart" in table
