"""Issue 42, point 5: bench repeats and interleaves by default, shows the spread of its ratios, and
does not call a winner where the spread crosses 1."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedModel

import criticalkv.bench.runner as runner
from criticalkv.bench import BenchConfig, run_bench
from criticalkv.bench.tables import SPREAD, derived, format_table, speedup_rounds
from criticalkv.cli import build_parser
from tests.helpers.tiny_tokenizer import char_tokenizer


def _record(method: str, best: float, rounds: list[float] | None) -> dict[str, Any]:
    return dict(
        impl="criticalkv", method=method, context_tokens=4096, budget=1.0 if method == "full" else 0.2,
        batch_size=1, prefill_s=1.0, compress_s=0.1, ttft_s=1.1, decode_ms_per_token=best, decode_tokens=32,
        tokens_per_s=1000 / best, kv_bytes=10, kv_bytes_full=50, kv_ratio=0.2, peak_rss_bytes=None,
        peak_device_bytes=None, device="cpu", decode_ms_rounds=rounds,
    )  # fmt: skip


def test_the_cli_default_repeats_three_times() -> None:
    args = build_parser().parse_args(["bench", "--context-lengths", "4096", "--budgets", "0.2"])
    assert args.repeats == 3


def test_rounds_are_interleaved_and_kept(tiny_llama: PreTrainedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    measure = runner.measure_run

    def logged(config: BenchConfig, run: Any, *args: Any) -> Any:
        order.append(run.method)
        return measure(config, run, *args)

    monkeypatch.setattr(runner, "measure_run", logged)
    config = BenchConfig(
        context_lengths=[96], methods=["snapkv"], budgets=[0.25], decode_tokens=3, window=8, kvpress="off", repeats=3
    )
    records = [r.to_dict() for r in run_bench(config, tiny_llama, char_tokenizer())]
    assert order == ["full", "snapkv"] * 3  # round by round, not full x3 then snapkv x3
    for r in records:
        assert len(r["decode_ms_rounds"]) == 3
        assert r["decode_ms_per_token"] == min(r["decode_ms_rounds"])
    row = {r["method"]: r for r in derived(records)}["snapkv"]
    low, high = row["decode_speedup_vs_full_range"]
    assert low <= high


def test_a_spread_across_one_is_no_winner() -> None:
    full = _record("full", 10.0, [10.0, 12.0, 30.0])
    crossing = _record("snapkv", 8.0, [8.0, 14.0, 9.0])  # 1.25x, 0.86x, 3.3x: rounds disagree
    clear = _record("adakv", 5.0, [5.0, 6.0, 15.0])  # 2.0x, 2.0x, 2.0x
    assert speedup_rounds(full, crossing) == pytest.approx((12 / 14, 30 / 9))
    table = format_table([full, crossing, clear])
    lines = {line.split()[1]: line.split() for line in table.splitlines()[2:5]}
    assert lines["snapkv"][11:13] == ["?", "0.86-3.33"]
    assert lines["adakv"][11:13] == ["2.00x", "2.00-2.00"]
    assert f"definition: {SPREAD}" in table


def test_one_round_shows_no_spread() -> None:
    table = format_table([_record("full", 10.0, [10.0]), _record("snapkv", 5.0, [5.0])])
    assert table.splitlines()[3].split()[11:13] == ["2.00x", "-"]


def test_crit_share_shows_its_round_by_round_spread() -> None:
    base = _record("snapkv", 8.0, [8.0, 8.0]) | {"compress_s_rounds": [0.10, 0.30], "prefill_s_rounds": [1.0, 1.0]}
    crit = _record("critical-snapkv", 8.0, [8.0, 8.0])
    crit |= {"compress_s": 0.2, "compress_s_rounds": [0.20, 0.35], "prefill_s_rounds": [1.0, 2.0]}
    rows = {r["method"]: r for r in derived([_record("full", 10.0, [10.0, 10.0]), base, crit])}
    low, high = rows["critical-snapkv"]["critical_overhead_range"]
    assert (low, high) == pytest.approx((0.025, 0.10))  # (0.35 - 0.30) / 2 and (0.20 - 0.10) / 1
    assert "10.00% (2.5-10.0)" in format_table([base, crit])
