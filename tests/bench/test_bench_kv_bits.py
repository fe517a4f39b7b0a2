"""``criticalkv bench --kv-bits``: our caches measured quantized beside unquantized in one run, the
kvpress pairs planned (or each missing one explained), and bad storage input refused with a sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from criticalkv.bench import BenchConfig, run_bench
from criticalkv.bench.kvpress_quantized import quanto_unavailable
from criticalkv.bench.plan import plan_runs
from criticalkv.bench.record import BenchRecord
from criticalkv.bench.runner import record_key
from criticalkv.bench.tables import derived, format_table
from criticalkv.cache import DecodeBudget, PromptTooShort
from criticalkv.cache.quantized import KVQuantization
from criticalkv.cli import main
from criticalkv.commands.bench import SPELLING
from tests.helpers.tiny_tokenizer import char_tokenizer


def _config(**changes: object) -> BenchConfig:
    base: dict[str, object] = dict(
        context_lengths=[96],
        methods=["snapkv", "critical-adakv"],
        budgets=[0.5],
        batch_sizes=[2],
        decode_tokens=3,
        window=8,
        kvpress="off",
        storage=KVQuantization(4, 8),
    )
    base.update(changes)
    return BenchConfig(**base)  # type: ignore[arg-type]


def _bits(record: BenchRecord) -> int | None:
    """The bits a record's entries were stored in as its JSON line spells them (``None``: unquantized)."""
    return record.to_dict()["kv_bits"]


def test_quantized_rows_beside_unquantized_ones(tiny_llama: PreTrainedModel, tmp_path: Path) -> None:
    records = run_bench(_config(), tiny_llama, char_tokenizer(), out=tmp_path)
    assert [(r.method, _bits(r)) for r in records] == [
        ("full", None),
        ("snapkv", None),
        ("snapkv", 4),
        ("critical-adakv", None),
        ("critical-adakv", 4),
    ]
    by = {(r.method, _bits(r)): r for r in records}
    for name in ("snapkv", "critical-adakv"):
        plain, four = by[(name, None)], by[(name, 4)]
        assert four.storage == KVQuantization(4, 8) and plain.storage is None
        spelled = four.to_dict()
        assert (spelled["kv_group_size"], spelled["kv_residual"]) == (8, None)  # None: the cache's default residual
        assert plain.kv_bytes == by[("snapkv", None)].kv_bytes  # same budget, same bytes (float32)
        assert four.kv_bytes_full == plain.kv_bytes_full
        assert four.kv_bytes < 0.5 * plain.kv_bytes  # 4-bit data + per-group scales and zero points
        assert four.bits_per_element is not None and plain.bits_per_element is not None
        assert four.bits_per_element < 16 <= 32 <= plain.bits_per_element  # float32, spare tail included
        assert four.kv_bytes_final is not None and four.kv_bytes_final >= four.kv_bytes
    rows = {(r["method"], r["kv_bits"]): r for r in derived([r.to_dict() for r in records])}
    four = rows[("snapkv", 4)]
    want = rows[("snapkv", None)]["decode_ms_per_token"] / four["decode_ms_per_token"]
    assert four["decode_vs_unquantized"] == pytest.approx(want)
    assert rows[("snapkv", None)]["decode_vs_unquantized"] is None
    assert four["decode_speedup_vs_full"] is not None  # against the one unquantized full cache
    table = format_table([r.to_dict() for r in records])
    assert "snapkv+q4" in table and "vs 16b" in table and "bits" in table
    assert record_key(by[("snapkv", 4)]) == "criticalkv|snapkv|96|0.5|2|kv=4/8/-"
    assert run_bench(_config(), tiny_llama, char_tokenizer(), out=tmp_path) == []  # resumed: nothing left
    resumed = run_bench(_config(storage=KVQuantization(4, 8, 4)), tiny_llama, char_tokenizer(), out=tmp_path)
    assert [_bits(r) for r in resumed] == [4, 4]  # another residual: other rows


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"storage": KVQuantization(4, 8, 40), "budgets": [32]}, "longer than the budget"),
        ({"decode": DecodeBudget(16), "storage": KVQuantization(4, 8, 32)}, "longer than the decode budget"),
        ({"methods": []}, "at least one method besides full"),
    ],
)
def test_config_rejects_bad_storage_input(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**changes)


def test_a_residual_longer_than_a_fraction_budget_is_refused_before_measuring(tiny_llama: PreTrainedModel) -> None:
    """0.25 of 96 tokens is 24 entries per head, shorter than a 40-token exact residual: refused by the
    row's spec (``check_compressible``), where it used to fail after the full cache was measured."""
    with pytest.raises(PromptTooShort) as refused:
        _config(storage=KVQuantization(4, 8, 40), budgets=[0.25])
    said = refused.value.spelled(SPELLING)  # as the command line says it: every option as its flag
    assert said.startswith("--budgets 0.25 at --context-lengths 96: the prompt has 96 tokens: ")
    assert "longer than the budget" in said and "pass --kv-residual <= 24 or a larger --budgets" in said


def test_group_size_must_divide_the_models_head_dimension(tiny_llama: PreTrainedModel) -> None:
    _config(storage=KVQuantization(4)).check_model(tiny_llama)  # the default 64 is a multiple of head_dim 16
    with pytest.raises(ValueError, match=r"group size \(kv_group_size\) 24 does not divide the head dimension 16"):
        _config(storage=KVQuantization(4, 24)).check_model(tiny_llama)


def _planned(config: BenchConfig, reason: str | None) -> tuple[list[str], list[str]]:
    runs, notes = plan_runs(config, True, lambda bits: reason)
    return [run.key for run in runs if run.impl == "kvpress"], notes


def test_kvpress_quantized_pairs_are_planned_or_explained() -> None:
    config = _config(methods=["snapkv", "h2o"], kvpress="auto")
    keys, notes = _planned(config, None)
    assert keys == ["kvpress|snapkv|96|0.5|2", "kvpress|snapkv|96|0.5|2|kv=4/8/-"]  # h2o: no kvpress press
    assert notes == ["h2o: kvpress has no counterpart press"]
    keys, notes = _planned(config, "optimum-quanto does not import")
    assert keys == ["kvpress|snapkv|96|0.5|2"]
    assert "kvpress on a quantized cache not measured: optimum-quanto does not import" in notes
    assert "stores 2 or 4 bits, not 8" in str(quanto_unavailable(8))


def test_kvpress_decode_pairs_are_planned_or_explained() -> None:
    config = _config(methods=["snapkv", "adakv", "knorm"], storage=None, kvpress="auto")
    config.decode = DecodeBudget(16, 8)
    keys, notes = _planned(config, None)
    assert keys == ["kvpress|knorm|96|0.5|2|decode=16/8"]
    assert any(n.startswith("snapkv: kvpress's DecodingPress scores on the last 8") for n in notes)
    assert any(n.startswith("adakv: kvpress has no DecodingPress counterpart") for n in notes)
    config.window = 4  # the interval now outnumbers the window: SnapKV pairs too
    keys, notes = _planned(config, None)
    assert keys == ["kvpress|snapkv|96|0.5|2|decode=16/8", "kvpress|knorm|96|0.5|2|decode=16/8"]


def test_the_kvpress_column_never_stays_blank() -> None:
    def record(impl: str, method: str, press: str | None = None) -> dict[str, object]:
        key = {"impl": impl, "method": method, "context_tokens": 96, "budget": 0.5, "batch_size": 1}
        times = {"decode_ms_per_token": 2.0, "compress_s": 0.1, "prefill_s": 1.0, "ttft_s": 1.1, "tokens_per_s": 1.0}
        return key | times | {"kv_bytes": 1e6, "kv_ratio": 0.5, "decode_budget": 16, "press": press}

    records = [record("criticalkv", m) for m in ("full", "snapkv", "knorm", "adakv")]
    records.append(record("kvpress", "knorm", "Decoding(Knorm)"))
    pairs = {(r["impl"], r["method"]): r["kvpress_pair"] for r in derived(records)}
    assert pairs[("criticalkv", "knorm")] == pairs[("kvpress", "knorm")] == "Decoding(Knorm)"
    assert pairs[("criticalkv", "adakv")] == "none"  # kvpress has no decoding counterpart
    assert pairs[("criticalkv", "snapkv")] == "not run"  # it has one, not measured here (see the notes)
    assert pairs[("criticalkv", "full")] == "-"
    table = format_table(records, ["adakv: kvpress has no DecodingPress counterpart"])
    assert "note: adakv: kvpress has no DecodingPress counterpart" in table.splitlines()


def _argv(model: Path | str, *extra: str) -> list[str]:
    argv = ["bench", "--model", str(model), "--context-lengths", "96", "--methods", "snapkv", "--budgets", "0.5"]
    return [*argv, "--decode-tokens", "2", "--window", "8", "--kvpress", "off", *extra]


def test_cli_kv_bits_records(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv(tiny_folder, "--kv-bits", "8", "--kv-group-size", "16", "--kv-residual", "4", "--json")) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["method"], r["kv_bits"], r["kv_group_size"], r["kv_residual"]) for r in records] == [
        ("full", None, None, None),
        ("snapkv", None, None, None),
        ("snapkv", 8, 16, 4),
    ]
    assert records[2]["kv_bytes"] < records[1]["kv_bytes"] and records[2]["bits_per_element"] < 16


def test_cli_rejects_unsupported_bits_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    """One --kv-bits for every command: argparse refuses a width it does not take."""
    with pytest.raises(SystemExit) as exit_:
        main(_argv("/nonexistent/model", "--kv-bits", "3"))
    assert exit_.value.code == 2 and "invalid choice: 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-group-size", "8"], "give --kv-bits 8 or 4 too"),
        (["--kv-bits", "4", "--kv-residual", "32", "--decode-budget", "16"], "longer than the decode budget"),
    ],
)
def test_cli_rejects_bad_storage_input_before_loading(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv("/nonexistent/model", *extra)) == 2  # refused before the (missing) model is looked for
    assert message in capsys.readouterr().err


def test_cli_rejects_a_group_size_the_head_dimension_does_not_take(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(tiny_folder, "--kv-bits", "4", "--kv-group-size", "5")) == 2
    assert "group size (--kv-group-size) 5 does not divide the head dimension 16" in capsys.readouterr().err


def test_cli_kv_bits_with_a_decode_budget(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Quantized storage under a decode budget: the quantized row stays held and below the unquantized one."""
    argv = _argv(tiny_folder, "--kv-bits", "4", "--kv-group-size", "8", "--kv-residual", "4", "--json")
    argv[argv.index("--decode-tokens") + 1] = "24"
    assert main([*argv, "--decode-budget", "24", "--decode-interval", "8"]) == 0
    records = json.loads(capsys.readouterr().out)
    plain, quantized = (r for r in records if r["method"] == "snapkv")
    assert quantized["kv_bits"] == 4 and plain["kv_bits"] is None
    # the compressed prompt is smaller; the peaks are close (the exact residual holds the newest 24 tokens,
    # and the unquantized tail no longer carries spare capacity)
    assert quantized["kv_bytes"] < plain["kv_bytes"]
    full = next(r for r in records if r["method"] == "full")
    assert plain["kv_bytes_peak"] < full["kv_bytes_peak"]  # held at the decode budget while full grows
