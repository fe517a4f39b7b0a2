"""Hostile cases on results folders: doubled and damaged lines, merged sweeps, edited and
over-long datasets, refused commands, a second writer (see docs/reliability-runs.md)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import criticalkv as ckv
from criticalkv.cli import main
from criticalkv.eval import results as sweep_results
from criticalkv.eval.report import build_report, format_tables, loss_reductions, summarise
from criticalkv.eval.sweep import SweepConfig, run_sweep
from criticalkv.runs import FolderBusy, writer_lock
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer


def rec(task: str, index: int, method: str, budget: float, score: float, **kw: Any) -> dict[str, Any]:
    """A synthetic result line (every field the report reads)."""
    base = dict(task=task, length=100, index=index, method=method, budget=budget, score=score, partial=score)
    base.update(nll=1.0, kl=0.0, top1=1.0, kv_bytes=10, kv_bytes_full=10, meta={})
    base.update(kw)
    return base


def write_lines(path: Path, rows: list[Any]) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def avg_row(rows: list[dict[str, Any]], method: str, budget: float) -> dict[str, Any]:
    return next(
        r for r in rows if (r["method"], r["budget"], r["task"], r["length"]) == (method, budget, "average", "all")
    )


# --- report: doubled, damaged and merged lines -------------------------------------------------


def test_report_counts_each_key_once_whatever_the_file_holds(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clean = [rec("t", i, m, b, s) for i in range(3) for m, b, s in (("full", 1.0, 1.0), ("snapkv", 0.2, i % 2))]
    doubled = [*clean, *clean[:4]]  # two writers, or a file concatenated by hand
    write_lines(tmp_path / sweep_results.RESULTS, doubled)
    with caplog.at_level(logging.WARNING):
        records = sweep_results.current_results(sweep_results.read_results(tmp_path), tmp_path / sweep_results.RESULTS)
    assert len(records) == len(clean) and "4 line(s) whose key appears again later" in caplog.text
    assert summarise(records) == summarise(clean)
    text, _ = build_report(tmp_path)
    assert avg_row(summarise(records), "snapkv", 0.2)["n"] == 3 and "33.3(3)" in text


def test_the_last_line_of_a_key_wins(tmp_path: Path) -> None:
    write_lines(tmp_path / sweep_results.RESULTS, [rec("t", 0, "full", 1.0, 0.0), rec("t", 0, "full", 1.0, 1.0)])
    assert [r["score"] for r in sweep_results.current_results(sweep_results.read_results(tmp_path))] == [1.0]


def test_lines_that_are_json_but_not_results_are_skipped_with_file_and_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = rec("t", 0, "full", 1.0, 1.0)
    rows = [good, {"task": "t"}, rec("t", 1, "full", 1.0, "high"), [1, 2], rec("t", 2, "full", True, 1.0), "\xff"]
    (tmp_path / sweep_results.RESULTS).write_bytes(
        b"".join((json.dumps(r).encode() if not isinstance(r, str) else b"\xff") + b"\n" for r in rows)
    )
    with caplog.at_level(logging.WARNING):
        assert sweep_results.read_results(tmp_path) == [good]
    for line, why in ((2, "no length"), (3, "score is 'high'"), (4, "a JSON list"), (5, "budget is True"), (6, "JSON")):
        assert f"line {line} of {tmp_path / sweep_results.RESULTS}" in caplog.text and why in caplog.text
    assert set(sweep_results.iter_done(tmp_path)) == {sweep_results.result_key(good)}


def test_merged_sweeps_show_n_and_compare_only_shared_samples() -> None:
    """full on 4 samples, snapkv on 4, critical-snapkv on the 2 where snapkv did worst."""
    full = [rec("t", i, "full", 1.0, 1.0) for i in range(4)]
    base = [rec("t", i, "snapkv", 0.2, s) for i, s in enumerate([0.0, 0.0, 1.0, 1.0])]
    crit = [rec("t", i, "critical-snapkv", 0.2, 0.5) for i in range(2)]
    rows = summarise(full + base + crit)
    assert avg_row(rows, "critical-snapkv", 0.2)["n"] == 2 and avg_row(rows, "snapkv", 0.2)["n"] == 4
    assert avg_row(rows, "snapkv", 0.2)["loss"] == pytest.approx(0.5)
    (red,) = loss_reductions(rows)
    # over samples 0 and 1 only: base loss 1.0, critical 0.5 (unpaired it would read 0.5 -> 0.5)
    assert (red["loss_base"], red["loss_critical"], red["n"]) == (pytest.approx(1.0), pytest.approx(0.5), 2)
    assert red["reduction"] == pytest.approx(0.5)
    table = format_tables(rows)
    assert "50.0(2)" in table and "50.0(4)" in table and "(n=2)" in table


# --- damaged folders and paths ---------------------------------------------------------------


def test_damaged_folders_get_a_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a results folder"):
        _config(a_file)
    (tmp_path / "r1" / sweep_results.RESULTS).mkdir(parents=True)
    assert main(["report", str(tmp_path / "r1")]) == 2
    assert "results.jsonl is a folder, not a results file" in capsys.readouterr().err
    (tmp_path / "r2").mkdir()
    (tmp_path / "r2" / sweep_results.RUN).write_text('{"identity": ')
    with pytest.raises(ValueError, match=r"run.json is damaged .*restore it"):
        sweep_results.check_run(tmp_path / "r2", {"model": "m"})


# --- sweeps on a tiny model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return char_tokenizer()


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return ckv.attach(make_tiny("llama"))


def _config(out: Path, **kw: Any) -> SweepConfig:
    base: dict[str, Any] = dict(
        out=out,
        tasks=["niah_single_1"],
        lengths=[600],
        methods=["full", "snapkv", "critical-snapkv"],
        budgets=[0.3],
        samples=1,
        window=8,
        max_new_tokens=4,
        model="tiny",
    )
    base.update(kw)
    return SweepConfig(**base)


def _dconfig(out: Path, data: Path | str, **kw: Any) -> SweepConfig:
    return _config(out, benchmark="dataset", dataset=str(data), tasks=[], samples=10, **kw)


def _dataset(path: Path, answers: list[str], long_line: int | None = None) -> Path:
    rows = []
    for i, answer in enumerate(answers):
        context = ("The grass is green. " * (400 if i == long_line else 6)) + f"The code is {answer}."
        rows.append({"context": context, "question": "Code?", "answers": [answer]})
    write_lines(path, rows)
    return path


def test_an_edited_dataset_line_is_recomputed_and_the_same_file_by_another_path_resumes(
    tmp_path: Path,
    tok,
    tiny,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.chdir(tmp_path)
    data = _dataset(Path("d.jsonl"), ["7", "8"])
    out = tmp_path / "run"
    run_sweep(_dconfig(out, data), tiny, tok)
    first = sweep_results.read_results(out)
    assert len(first) == 2 * 3 and all(r["meta"]["sha256"] for r in first)
    # the same file by its absolute path: accepted, nothing to do
    run_sweep(_dconfig(out, data.resolve()), tiny, tok)
    assert sweep_results.read_results(out) == first
    _dataset(data, ["7", "9"])  # line 2's answer changes
    run_sweep(_dconfig(out, data), tiny, tok)
    lines = sweep_results.read_results(out)
    assert len(lines) == 2 * 3 + 3 and {r["index"] for r in lines[6:]} == {2}
    assert {tuple(r["answers"]) for r in lines[6:]} == {("9",)}
    with caplog.at_level(logging.WARNING):
        current = sweep_results.current_results(lines)
    assert len(current) == 6 and {tuple(r["answers"]) for r in current if r["index"] == 2} == {("9",)}
    # only one method recomputed after another edit: the other methods' old lines are not counted
    _dataset(data, ["7", "10"])
    run_sweep(_dconfig(out, data, methods=["full"]), tiny, tok)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        current = sweep_results.current_results(sweep_results.read_results(out))
    assert {(r["index"], r["method"]) for r in current} == {
        (1, "full"),
        (1, "snapkv"),
        (1, "critical-snapkv"),
        (2, "full"),
    }
    assert "ignoring 2 result(s) computed on an earlier version" in caplog.text


def test_a_dataset_folder_of_the_earlier_store_is_refused_with_what_to_do(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "d.jsonl", ["7"])
    config = _dconfig(tmp_path / "run", data)
    old = {k: v for k, v in config.identity().items() if k != sweep_results.DATASET_CHECK} | {"dataset": str(data)}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / sweep_results.RUN).write_text(json.dumps({"identity": old, "runs": []}))
    with pytest.raises(ValueError, match=r"written before samples were identified by content.*new --out"):
        sweep_results.check_run(config.out, config.identity())


def test_an_over_long_dataset_line_is_skipped_and_counted(tmp_path: Path, tok, tiny, caplog) -> None:  # type: ignore[no-untyped-def]
    data = _dataset(tmp_path / "d.jsonl", ["7", "8", "9"], long_line=1)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        run_sweep(_dconfig(out, data), tiny, tok)
    assert "skipping a sample: d sample 2 needs" in caplog.text and "shorten it" in caplog.text
    assert {r["index"] for r in sweep_results.read_results(out)} == {1, 3}
    text, _ = build_report(out)
    assert "skipped 1 sample(s) longer than the model accepts (not in the table): d line 2" in text


def test_a_dataset_line_shorter_than_the_window_is_skipped_and_named(tmp_path: Path, tok, tiny, caplog) -> None:  # type: ignore[no-untyped-def]
    """Issue 30, case 8: a line too short for its budget to hold the window ("Hi") stopped the
    sweep after the good lines with an internal message naming no line; now it is skipped like an
    over-long line and the report names it."""
    data = tmp_path / "d.jsonl"
    good = "The grass is green. " * 6
    rows = [{"context": good + f"The code is {a}.", "question": "Code?", "answers": [a]} for a in ("7", "8")]
    rows.insert(1, {"context": "Hi", "question": "?", "answers": ["x"]})
    write_lines(data, rows)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        run_sweep(_dconfig(out, data, chat=False), tiny, tok)
    assert "d sample 2: the prompt has 12 tokens" in caplog.text
    assert "smaller than the observation window (8 tokens)" in caplog.text
    assert {r["index"] for r in sweep_results.read_results(out)} == {1, 3}
    text, _ = build_report(out)
    assert "skipped 1 sample(s) too short for the budget and observation window (not in the table): d line 2" in text


def test_a_refused_sweep_writes_nothing(tmp_path: Path, tok, tiny) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="at most 1024 positions"):
        run_sweep(_config(out, lengths=[1022]), tiny, tok)
    assert not out.exists()
    # refused at its first sample (chat template and answer beyond the model): run.json removed again
    with pytest.raises(ValueError, match="more than the model's 1024"):
        run_sweep(_config(out, lengths=[1000]), tiny, tok)
    assert sorted(p.name for p in out.iterdir()) == ["writer.lock"]
    run_sweep(_config(out, window=12), tiny, tok)  # the corrected command, another window: accepted
    assert len(sweep_results.read_results(out)) == 3


def test_a_second_writer_waits_then_refuses_naming_the_holder(tmp_path: Path, tok, tiny) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    with writer_lock(out):
        with pytest.raises(FolderBusy, match=rf"another process \(pid {os.getpid()} on .*\) is writing to {out}"):
            run_sweep(_config(out), tiny, tok, wait=0.2)
        assert not (out / sweep_results.RUN).exists()
    run_sweep(_config(out), tiny, tok, wait=0)  # free again
    assert len(sweep_results.read_results(out)) == 3


def test_unusable_dataset_lines_are_counted_and_named_in_the_report(tmp_path: Path, tok, tiny) -> None:  # type: ignore[no-untyped-def]
    """Issue 30, cases 5 and 8: a blank answer and a malformed line are skipped, counted and named
    (line and why) in skipped.jsonl and the report, once however often the sweep resumes."""
    data = tmp_path / "d.jsonl"
    good = "The grass is green. " * 6
    rows = [{"context": good + f"The code is {a}.", "question": "Code?", "answers": [a]} for a in ("7", "8")]
    rows.insert(1, {"context": good, "question": "Code?", "answers": [" "]})
    write_lines(data, rows)
    with data.open("a") as fh:
        fh.write("not json\n")
    out = tmp_path / "run"
    run_sweep(_dconfig(out, data), tiny, tok)
    run_sweep(_dconfig(out, data), tiny, tok)  # resumed: nothing listed twice
    skipped = [s for s in sweep_results.read_skipped(out) if s["reason"] == "unusable"]
    assert sorted(s["index"] for s in skipped) == [2, 4]
    assert "blank" in " ".join(s["why"] for s in skipped) or "whitespace" in " ".join(s["why"] for s in skipped)
    assert len((out / "skipped.jsonl").read_text().splitlines()) == 2
    text, _ = build_report(out)
    assert "skipped 2 sample(s) on lines that are not usable samples (malformed, or a blank answer)" in text
    assert "d line 2, d line 4" in text


def test_a_disk_that_fills_mid_sweep_then_frees_resumes_to_the_uninterrupted_report(
    tmp_path: Path, tok, tiny, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Issue 30, case 1 at the sweep level: the disk fills after three result lines (the next write
    comes out short, then writes fail): the sweep stops with a sentence and a whole file; space is
    freed and the same command resumes to the uninterrupted run's results and report. Before,
    the short write left a torn line, the sweep went on with exit 0 and lines were lost."""
    import errno
    import os

    data = _dataset(tmp_path / "d.jsonl", ["7", "8", "9", "5"])
    whole = tmp_path / "whole"
    run_sweep(_dconfig(whole, data), tiny, tok)
    out, real, written = tmp_path / "run", os.write, []

    def filling(fd: int, payload: bytes) -> int:
        if b'"index"' not in payload:
            return real(fd, payload)  # only results lines meet the full disk
        written.append(1)
        if len(written) == 4:
            return real(fd, payload[:7])
        if len(written) > 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, payload)

    monkeypatch.setattr(os, "write", filling)
    with pytest.raises(ValueError, match=r"No space left on device \(ENOSPC\).*run the same command again"):
        run_sweep(_dconfig(out, data), tiny, tok)
    monkeypatch.setattr(os, "write", real)
    assert (out / "results.jsonl").read_bytes().endswith(b"\n")
    run_sweep(_dconfig(out, data), tiny, tok)  # space freed: resumed
    key = lambda r: (r["index"], r["method"], r["budget"])  # noqa: E731
    ours = {key(r): (r["score"], r["prediction"]) for r in sweep_results.read_results(out)}
    theirs = {key(r): (r["score"], r["prediction"]) for r in sweep_results.read_results(whole)}
    assert ours == theirs and len(ours) == 12
    assert build_report(out)[0].replace(str(out), "") == build_report(whole)[0].replace(str(whole), "")
