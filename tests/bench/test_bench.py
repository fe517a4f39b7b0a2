"""``criticalkv bench``: records, memory bounds, resume, report and the CLI (tiny models; no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from criticalkv.bench import BenchConfig, run_bench
from criticalkv.bench.figure import plot
from criticalkv.bench.kvpress_impl import import_kvpress, measure_kvpress
from criticalkv.bench.prompt import bench_prompts
from criticalkv.bench.runner import load_records
from criticalkv.bench.tables import CRITICAL_EXTRA, caveats, derived, format_table
from criticalkv.cli import main
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer

REQUIRED = {
    "impl",
    "method",
    "context_tokens",
    "budget",
    "prefill_s",
    "compress_s",
    "decode_ms_per_token",
    "kv_bytes",
    "kv_bytes_full",
    "peak_rss_bytes",
}


def _config(**changes: object) -> BenchConfig:
    base: dict[str, object] = dict(
        context_lengths=[96, 160],
        methods=["snapkv", "critical-adakv"],
        budgets=[0.25],
        batch_sizes=[1, 2],
        decode_tokens=3,
        window=8,
        kvpress="off",
    )
    base.update(changes)
    return BenchConfig(**base)  # type: ignore[arg-type]


def test_records_cover_the_grid_and_respect_the_budget(tiny_llama: PreTrainedModel) -> None:
    records = run_bench(_config(), tiny_llama, char_tokenizer())
    assert len(records) == 2 * 2 * 3  # lengths x batch sizes x (full + 2 methods)
    for r in records:
        data = r.to_dict()
        assert set(data) >= REQUIRED
        assert r.impl == "criticalkv" and r.decode_ms_per_token > 0 and r.prefill_s > 0
        assert r.tokens_per_s == pytest.approx(r.batch_size * 1e3 / r.decode_ms_per_token)
        assert r.peak_rss_bytes is None or r.peak_rss_bytes > 0
        if r.method == "full":
            assert r.compress_s == 0 and r.kv_bytes == r.kv_bytes_full > 0
        else:
            assert r.compress_s > 0
            # the bytes held after compression: at most budget x full + 2% (window included)
            assert r.kv_bytes <= (r.budget + 0.02) * r.kv_bytes_full
    # every method holds the same bytes per row for the same budget (adaptive ones included)
    by_key = {(r.method, r.context_tokens, r.batch_size): r.kv_bytes for r in records}
    assert by_key[("snapkv", 160, 2)] == by_key[("critical-adakv", 160, 2)] == 2 * by_key[("snapkv", 160, 1)]


def test_interrupted_run_resumes_without_duplicates(tiny_llama: PreTrainedModel, tmp_path: Path) -> None:
    config = _config(context_lengths=[96], batch_sizes=[1])
    first = run_bench(config, tiny_llama, char_tokenizer(), out=tmp_path)
    assert len(first) == 3
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    (tmp_path / "records.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])  # torn last line
    again = run_bench(config, tiny_llama, char_tokenizer(), out=tmp_path)
    assert [r.method for r in again] == ["critical-adakv"]
    keys = [(r["impl"], r["method"]) for r in load_records(tmp_path / "records.jsonl")]
    assert sorted(keys) == sorted([("criticalkv", "full"), ("criticalkv", "snapkv"), ("criticalkv", "critical-adakv")])
    assert run_bench(config, tiny_llama, char_tokenizer(), out=tmp_path) == []


def test_report_ratios_table_and_plot(tiny_llama: PreTrainedModel, tmp_path: Path) -> None:
    config = _config(context_lengths=[96], batch_sizes=[1], methods=["adakv", "critical-adakv"])
    records = [r.to_dict() for r in run_bench(config, tiny_llama, char_tokenizer())]
    rows = {r["method"]: r for r in derived(records)}
    assert rows["full"]["decode_speedup_vs_full"] == pytest.approx(1.0)
    crit = rows["critical-adakv"]
    want = (crit["compress_s"] - rows["adakv"]["compress_s"]) / crit["prefill_s"]
    assert crit["critical_overhead"] == pytest.approx(want)
    assert rows["adakv"]["critical_overhead"] is None
    table = format_table(records)
    assert "critical-adakv" in table and "vs full" in table
    assert "crit +%" in table and f"definition: {CRITICAL_EXTRA}" in table  # the column says what it is
    png = plot(records, tmp_path / "bench.png", "tiny")  # one context length: bars, not a column of dots
    assert png.stat().st_size > 1000
    two = [r.to_dict() for r in run_bench(_config(batch_sizes=[1], methods=["snapkv"]), tiny_llama, char_tokenizer())]
    assert plot(two, tmp_path / "two.png", "tiny", caveats(1)).stat().st_size > 1000


def test_bench_warns_on_one_repeat_or_a_loaded_machine() -> None:
    """Issue 29, point 6: single-run ratios and a busy machine are said beside the figures."""
    assert caveats(3, load=0.5, cores=2) == []
    one = caveats(1, load=0.5, cores=2)
    assert len(one) == 1 and "--repeats 1" in one[0]
    busy = caveats(5, load=3.5, cores=2)
    assert len(busy) == 1 and "load average (3.50 over 1 min) is above the 2 cores" in busy[0]
    assert len(caveats(1, load=9.0, cores=2)) == 2


def test_prompts_are_distinct_rows_without_padding() -> None:
    ids = bench_prompts(char_tokenizer(), 50, 3)
    assert ids.shape == (3, 50)
    assert not (ids == 0).any()
    assert len({tuple(row.tolist()) for row in ids}) == 3


def test_cli_json_lists_one_record_per_run(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", str(tiny_folder), "--context-lengths", "96", "--methods", "snapkv"]
    argv += ["--budgets", "0.25", "--decode-tokens", "2", "--window", "8", "--kvpress", "off", "--json"]
    assert main(argv) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["impl"], r["method"]) for r in records] == [("criticalkv", "full"), ("criticalkv", "snapkv")]
    assert all(set(r) >= REQUIRED for r in records)


def test_cli_writes_outputs(tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", str(tiny_folder), "--context-lengths", "96", "--methods", "critical-snapkv"]
    argv += ["--decode-tokens", "2", "--window", "8", "--kvpress", "off", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "critical-snapkv" in out
    for name in ("records.jsonl", "results.json", "table.txt", "bench.png"):
        assert (tmp_path / name).is_file()
    assert len(json.loads((tmp_path / "results.json").read_text())) == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--context-lengths", "2000"], "at most 1024 positions"),
        (
            ["--context-lengths", "4"],
            "--context-lengths 4: the context has 4 tokens, fewer than the observation window (8)",
        ),
        (["--context-lengths", "8"], "--budgets 0.2 at --context-lengths 8: the prompt has 8 tokens: the budget"),
        (["--decode-tokens", "0"], "decode_tokens"),
        (["--batch-sizes", "0"], "batch sizes"),
        (["--methods", "nope"], "unknown method"),
    ],
)
def test_cli_rejects_bad_input(
    tiny_folder: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--model", str(tiny_folder), "--window", "8", "--kvpress", "off", *extra]
    with pytest.raises(SystemExit) if extra[0] == "--methods" else _no_exit():
        assert main(argv) == 2
    assert message in capsys.readouterr().err


class _no_exit:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


@pytest.mark.skipif(import_kvpress() is not None, reason="kvpress is installed here")
def test_kvpress_required_but_missing_is_an_actionable_error(tiny_llama: PreTrainedModel) -> None:
    with pytest.raises(ValueError, match=r"pip install -e '\.\[bench\]'"):
        run_bench(_config(kvpress="on"), tiny_llama, char_tokenizer())


@pytest.mark.skipif(import_kvpress() is None, reason="kvpress is not installed (pip install 'criticalkv[bench]')")
def test_kvpress_adakv_holds_the_full_cache_and_snapkv_shrinks_it() -> None:
    kvpress, model = import_kvpress(), make_tiny("llama")
    ids = bench_prompts(char_tokenizer(), 128, 1)
    ada = measure_kvpress(kvpress, model, ids, "adakv", 0.25, 8, 2)
    snap = measure_kvpress(kvpress, model, ids, "snapkv", 0.25, 8, 2)
    assert ada.kv_bytes == ada.kv_bytes_full
    assert snap.kv_bytes < 0.3 * snap.kv_bytes_full


def test_norm_precision_override_reaches_the_selection(tiny_llama: PreTrainedModel) -> None:
    from criticalkv.bench.runner import with_norm_precision
    from criticalkv.methods import get_method

    exact = with_norm_precision(get_method("critical-adakv"), "exact")
    assert exact.select.precision == "exact"  # type: ignore[attr-defined]
    assert with_norm_precision(get_method("snapkv"), "exact") == get_method("snapkv")  # no norms: unchanged
    records = run_bench(
        _config(context_lengths=[96], batch_sizes=[1], norm_precision="exact"), tiny_llama, char_tokenizer()
    )
    assert [r.method for r in records] == ["full", "snapkv", "critical-adakv"]
    with pytest.raises(ValueError, match="norm precision"):
        _config(norm_precision="half")


def test_decode_vs_uniform_is_snapkvs_time_at_the_same_budget_over_the_methods() -> None:
    def record(method: str, budget: float, ms: float, context: int = 4096) -> dict[str, object]:
        key = {"impl": "criticalkv", "method": method, "context_tokens": context, "budget": budget, "batch_size": 1}
        times = {"decode_ms_per_token": ms, "compress_s": 0.1, "prefill_s": 1.0, "ttft_s": 1.1, "tokens_per_s": 1.0}
        return key | times | {"kv_bytes": 1e6 * budget, "kv_ratio": budget}

    records = [record("full", 1.0, 80.0), record("snapkv", 0.2, 60.0), record("adakv", 0.2, 63.0)]
    records += [record("adakv", 0.4, 70.0), record("adakv", 0.2, 90.0, context=8192)]  # no SnapKV beside them
    rows = derived(records)
    assert rows[2]["decode_vs_uniform"] == pytest.approx(60.0 / 63.0)
    assert [r["decode_vs_uniform"] for r in (rows[0], rows[1], rows[3], rows[4])] == [None] * 4
    assert "vs snap" in format_table(records) and "0.95x" in format_table(records)
