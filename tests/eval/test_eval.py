"""The evaluation harness: RULER generators, metrics, datasets, resumable sweeps, reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import criticalkv as ckv
from criticalkv.eval import results as sweep_results
from criticalkv.eval.report import build_report, loss_reductions, summarise
from criticalkv.eval.sweep import SweepConfig, run_sweep
from criticalkv.eval.sweep import runner as runner_module
from criticalkv.eval.tasks import (
    TASK_NAMES,
    char_credit,
    get_metric,
    load_dataset_file,
    make_sample,
    string_match_all,
    string_match_part,
)
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return char_tokenizer()


@pytest.mark.parametrize("task", TASK_NAMES)
@pytest.mark.parametrize("length", [1200, 3000])
def test_generators_hit_the_length_and_hide_the_answer(task: str, length: int, tok) -> None:  # type: ignore[no-untyped-def]
    sample = make_sample(task, tok, length, index=3)
    n = len(tok(sample.context + "\n" + sample.question, add_special_tokens=False)["input_ids"])
    assert length * 0.85 <= n <= length, (task, n)
    assert sample.answers and all(a in sample.context for a in sample.answers)
    again = make_sample(task, tok, length, index=3)
    assert again == sample  # deterministic
    assert make_sample(task, tok, length, index=4).context != sample.context


def test_unknown_task_and_tiny_length(tok) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="unknown RULER task"):
        make_sample("niah_single_9", tok, 1024, 0)
    with pytest.raises(ValueError, match="start at 128"):
        make_sample("vt", tok, 64, 0)


def test_metrics_against_hand_computed_values() -> None:
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("ABC", ["abc"]) == 1.0
    assert string_match_part("Paris, France", ["London", "paris"]) == 1.0
    assert string_match_part("Rome", ["London", "Paris"]) == 0.0
    assert char_credit("it is 1234500", ["1234567"]) == pytest.approx(5 / 7)
    assert char_credit("nothing", ["42"]) == 0.0
    with pytest.raises(ValueError, match="unknown metric"):
        get_metric("bleu")


def test_dataset_file_reports_bad_lines_and_keeps_the_rest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "mine.jsonl"
    lines = [
        json.dumps({"context": "The key is 42.", "question": "What is the key?", "answers": ["42"]}),
        "{not json",
        json.dumps({"context": "x", "question": "y"}),
        json.dumps({"context": "a", "question": "b", "answers": ["c"], "metric": "bleu"}),
        json.dumps({"context": "Blue sky.", "question": "Color?", "answers": "blue", "metric": "string_match_all"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    samples = load_dataset_file(path)
    assert [s.index for s in samples] == [1, 5]
    assert samples[1].answers == ["blue"] and samples[1].metric == "string_match_all"
    text = caplog.text
    assert "mine.jsonl:2" in text and "mine.jsonl:3" in text and "mine.jsonl:4" in text and "bleu" in text


def _config(out: Path, **kw: object) -> SweepConfig:
    base: dict[str, object] = dict(
        out=out,
        tasks=["niah_single_1", "qa_1"],
        lengths=[600],
        methods=["full", "snapkv", "critical-snapkv", "h2o"],
        budgets=[0.3, 0.6],
        samples=2,
        window=8,
        max_new_tokens=4,
        model="tiny",
    )
    base.update(kw)
    return SweepConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return ckv.attach(make_tiny("llama"))


def test_sweep_resumes_after_interruption_without_duplicates(tmp_path: Path, tok, tiny, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    config = _config(out)
    expected = 2 * 1 * 2 * len(config.configs())
    real_append = sweep_results.append_result
    calls = {"n": 0}

    def flaky(out_dir: Path, record: dict[str, object]) -> None:
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt  # killed midway
        real_append(out_dir, record)

    monkeypatch.setattr(runner_module, "append_result", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(config, tiny, tok)
    assert len(sweep_results.read_results(out)) == 6
    monkeypatch.setattr(runner_module, "append_result", real_append)
    run_sweep(config, tiny, tok)
    records = sweep_results.read_results(out)
    keys = [sweep_results.result_key(r) for r in records]
    assert len(keys) == expected == len(set(keys))
    run_sweep(config, tiny, tok)  # nothing left to do
    assert len(sweep_results.read_results(out)) == expected
    run = json.loads((out / "run.json").read_text())
    assert run["identity"]["model"] == "tiny" and len(run["runs"]) == 3
    assert {"criticalkv", "torch", "transformers"} <= set(run["runs"][0]["versions"])


def test_fidelity_is_zero_for_full_and_report_columns(tmp_path: Path, tok, tiny) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    run_sweep(_config(out), tiny, tok)
    records = sweep_results.read_results(out)
    for r in records:
        if r["method"] == "full":
            assert r["kl"] == pytest.approx(0.0, abs=1e-6) and r["top1"] == 1.0
            assert r["kv_bytes"] == r["kv_bytes_full"]
        else:
            assert r["kv_bytes"] < r["kv_bytes_full"]
    text, plots = build_report(out)
    header = (out / "summary.csv").read_text().splitlines()[0].split(",")
    assert {"method", "budget", "task", "score", "loss", "nll_increase"} <= set(header)
    rows = summarise(records)
    full_avg = [r for r in rows if r["method"] == "full" and r["task"] == "average" and r["length"] == "all"]
    assert len(full_avg) == 1 and full_avg[0]["nll_increase"] == pytest.approx(0.0, abs=1e-6)
    assert "loss reduction" in text and all(p.exists() for p in plots)
    assert {r["method"] for r in loss_reductions(rows)} == {"critical-snapkv"}


def test_report_command_and_changed_config_is_refused(tmp_path: Path, tok, tiny, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    run_sweep(_config(out, tasks=["niah_single_1"], samples=1), tiny, tok)
    from criticalkv.cli import main

    assert not (out / "summary.csv").exists()
    assert main(["report", str(out)]) == 0
    assert (out / "summary.csv").exists() and "critical-snapkv" in capsys.readouterr().out
    with pytest.raises(ValueError, match="different configuration"):
        run_sweep(_config(out, tasks=["niah_single_1"], samples=1, window=12), tiny, tok)


def test_torn_last_line_is_dropped(tmp_path: Path) -> None:
    from criticalkv.runs import JsonLines

    (tmp_path / "results.jsonl").write_text(json.dumps({"a": 1}) + "\n" + '{"b": ')
    assert JsonLines(tmp_path / "results.jsonl").rows() == [{"a": 1}]
    JsonLines(tmp_path / "results.jsonl").append([{"c": 2}])  # the writer drops it (readers leave the file alone)
    assert (tmp_path / "results.jsonl").read_text().endswith('{"a": 1}\n{"c": 2}\n')


def test_sweep_config_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown RULER task"):
        _config(tmp_path, tasks=["nope"])
    with pytest.raises(ValueError, match="unknown method"):
        _config(tmp_path, methods=["nope"])
    with pytest.raises(ValueError, match="mode"):
        _config(tmp_path, mode="sideways")


def test_length_beyond_the_model_is_refused(tmp_path: Path, tok, tiny) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="at most 1024 positions"):
        run_sweep(_config(tmp_path / "r", lengths=[1022]), tiny, tok)
    with pytest.raises(ValueError, match="more than the model's 1024"):
        run_sweep(_config(tmp_path / "s", lengths=[1000]), tiny, tok)


def test_dataset_sweep(tmp_path: Path, tok, tiny) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "d.jsonl"
    filler = "The grass is green. " * 20
    data.write_text(json.dumps({"context": filler + "The code is 7.", "question": "Code?", "answers": ["7"]}) + "\n")
    out = tmp_path / "run"
    run_sweep(_config(out, benchmark="dataset", dataset=str(data), tasks=[]), tiny, tok)
    records = sweep_results.read_results(out)
    assert {r["task"] for r in records} == {"d"} and len(records) == 7


@torch.no_grad()
def test_stacked_rows_equal_single_caches(tiny) -> None:  # type: ignore[no-untyped-def]
    """Each row of a stacked cache decodes exactly like that config's own cache."""
    from criticalkv.cache.batch import row_kv_bytes, stacked_cache
    from criticalkv.prompts import positions
    from criticalkv.runtime import prefill
    from tests.conftest import padded_batch

    ids, mask = padded_batch([80], seed=5)
    states, _ = prefill(tiny, ids, mask, window=6)
    configs = [("full", 1.0), ("snapkv", 0.3), ("critical-adakv", 0.3), ("adakv", 20)]
    stacked, times = stacked_cache(states, [ckv.CacheSpec.of(m, b, 6) for m, b in configs])
    assert len(times) == 4
    nxt = torch.tensor([[9]])
    m2 = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], 1)
    batch = tiny(
        input_ids=nxt.expand(4, -1),
        attention_mask=m2.expand(4, -1),
        position_ids=positions(m2).expand(4, -1)[:, -1:],
        cache=stacked,
    ).logits
    for row, (method, budget) in enumerate(configs):
        single = ckv.CompressedCache.from_states(states, method, budget)
        assert row_kv_bytes(stacked)[row] == single.kv_bytes()
        alone = tiny(input_ids=nxt, attention_mask=m2, position_ids=positions(m2)[:, -1:], cache=single).logits
        assert torch.allclose(batch[row], alone[0], atol=1e-5), method
