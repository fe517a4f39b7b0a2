"""Run the benchmark grid: (context length x batch size) x (full, methods x budgets) x implementations."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from criticalkv.bench.config import BenchConfig
from criticalkv.bench.folder import open_bench_folder
from criticalkv.bench.kvpress_decode import measure_kvpress_decode
from criticalkv.bench.kvpress_impl import import_kvpress, measure_kvpress
from criticalkv.bench.kvpress_quantized import pair_unavailable
from criticalkv.bench.ours import measure_criticalkv, measure_full
from criticalkv.bench.plan import Run, plan_runs
from criticalkv.bench.plan import record_key as _data_key
from criticalkv.bench.prompt import bench_prompts
from criticalkv.bench.record import BenchRecord
from criticalkv.cache import bind_spec
from criticalkv.methods import Method
from criticalkv.runs import FolderBusy, writer_lock
from criticalkv.runtime.forward import input_device

logger = logging.getLogger(__name__)

__all__ = ["BenchConfig", "load_records", "measure_run", "record_key", "run_bench", "with_norm_precision"]


def with_norm_precision(method: Method, precision: str | None) -> Method:
    """``method`` with its selection's value-norm precision set (methods without one unchanged)."""
    return method.with_norm_precision(precision)


def record_key(record: BenchRecord | dict[str, Any]) -> str:
    """What identifies a record in ``records.jsonl`` (the decode and storage settings only when set)."""
    return _data_key(record.to_dict() if isinstance(record, BenchRecord) else record)


def _append(path: Path, record: BenchRecord) -> None:
    line = json.dumps(record.to_dict()) + "\n"
    with path.open("a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def _drop_torn_tail(path: Path) -> None:
    """Cut an unfinished last line (an interrupted write) so appends start on a fresh line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        logger.warning("dropping an unfinished last line of %s", path)
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


def load_records(path: Path) -> list[dict[str, Any]]:
    """Records of a ``records.jsonl`` (a torn last line is ignored)."""
    out: list[dict[str, Any]] = []
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("ignoring a torn line in %s", path)
    return out


def _warm_up(model: Any, device: torch.device, vocab_ids: torch.Tensor) -> None:
    """One short untimed prefill and decode so one-off kernel set-up is not timed."""
    measure_full(model, vocab_ids.to(device), decode_tokens=2)


def run_bench(
    config: BenchConfig,
    model: Any,
    tokenizer: Any,
    *,
    kvpress_model: Any | None = None,
    out: Path | None = None,
    on_record: Callable[[BenchRecord], None] | None = None,
    notes: list[str] | None = None,
) -> list[BenchRecord]:
    """Measure every configuration of ``config``; returns the records (in measurement order).

    ``kvpress_model`` is a second, plain copy of the model for kvpress (its presses hook the
    model's attention modules; criticalkv's model is attached to our attention function).
    With ``out``, each record is appended to ``out/records.jsonl`` as soon as it is measured,
    and configurations already there are skipped (an interrupted run resumes).
    With ``repeats > 1`` each configuration is measured that many times and the fastest
    prefill, compression and decode are kept (the usual way to discount machine noise).
    ``notes``, if given, receives a sentence for every kvpress counterpart not measured and why.
    ``out`` takes one writer at a time (:func:`criticalkv.runs.writer_lock`) and holds records of
    one setup (:mod:`criticalkv.bench.folder`).

    Raises
    ------
    ValueError
        If ``out`` holds records of another setup, or another process is writing to it
        (:class:`~criticalkv.runs.FolderBusy`).
    """
    config.check_model(model)
    if out is None:
        return _run_bench(config, model, tokenizer, kvpress_model, None, on_record, notes)
    with contextlib.ExitStack() as held:
        try:  # one writer per folder: a second run into it is refused, not interleaved
            held.enter_context(writer_lock(out, wait=0))
        except FolderBusy as busy:  # bench has no --wait: the sentence without that advice
            raise FolderBusy(str(busy).replace(" (or pass --wait SECONDS to queue behind it)", "")) from None
        return _run_bench(config, model, tokenizer, kvpress_model, out, on_record, notes)


def _run_bench(
    config: BenchConfig,
    model: Any,
    tokenizer: Any,
    kvpress_model: Any,
    out: Path | None,
    on_record: Callable[[BenchRecord], None] | None,
    notes: list[str] | None,
) -> list[BenchRecord]:
    kvpress = None
    if config.kvpress != "off":
        kvpress = import_kvpress()
        if kvpress is None and config.kvpress == "on":
            raise ValueError(
                "kvpress is not importable here; install it with: pip install -e '.[bench]' "
                "(kvpress 0.5.5 needs transformers < 5.3)"
            )
        if kvpress is not None and kvpress_model is None:
            raise ValueError("comparing with kvpress needs kvpress_model, a second copy of the model")
    device = input_device(model)
    done: set[str] = set()
    records_path = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        open_bench_folder(out, config, model, kvpress is not None)  # refuses records of another setup
        records_path = out / "records.jsonl"
        _drop_torn_tail(records_path)
        done = {record_key(r) for r in load_records(records_path)}
    plan, skipped = plan_runs(config, kvpress is not None, pair_unavailable)
    if notes is not None:
        notes.extend(skipped)
    # a token count is recorded (and keyed) as a float above 1, as records always held budgets;
    # the full cache keeps everything, so it is the same record with or without a decode budget
    todo = [run for run in plan if run.key not in done]
    records: list[BenchRecord] = []
    if not todo:
        return records
    _warm_up(model, device, bench_prompts(tokenizer, 64, 1))
    if kvpress is not None and kvpress_model is not None:
        _warm_up(kvpress_model, device, bench_prompts(tokenizer, 64, 1))
    groups: dict[tuple[int, int], list[Run]] = {}
    for run in todo:
        groups.setdefault((run.length, run.batch), []).append(run)
    progress = tqdm(total=len(todo) * config.repeats, desc="bench", unit="run")
    for (length, batch), group in groups.items():
        ids = bench_prompts(tokenizer, length, batch).to(device)
        for record in _interleaved(config, group, ids, model, kvpress, kvpress_model, progress.update):
            records.append(record)
            if records_path is not None:
                _append(records_path, record)
            if on_record is not None:
                on_record(record)
    progress.close()
    return records


def _interleaved(
    config: BenchConfig,
    group: Sequence[Run],
    ids: torch.Tensor,
    model: Any,
    kvpress: Any,
    kvpress_model: Any,
    tick: Callable[[int], Any],
) -> list[BenchRecord]:
    """Each run of one (length, batch) measured ``config.repeats`` times in rounds (full, a, b, full,
    a, b, ...), so that a change of machine load meets every method alike; each record keeps its
    fastest times and, in ``decode_ms_rounds``, every round's decode ms/token (paired by round)."""
    tries: list[list[BenchRecord]] = [[] for _ in group]
    for _ in range(config.repeats):
        for runs, run in zip(tries, group, strict=True):
            runs.append(measure_run(config, run, ids, model, kvpress, kvpress_model))
            tick(1)
    out = []
    for runs in tries:
        record = _fastest(runs)
        record.decode_ms_rounds = [t.decode_ms_per_token for t in runs]
        record.compress_s_rounds = [t.compress_s for t in runs]
        record.prefill_s_rounds = [t.prefill_s for t in runs]
        out.append(record)
    return out


def measure_run(
    config: BenchConfig, run: Run, ids: torch.Tensor, model: Any, kvpress: Any, kvpress_model: Any
) -> BenchRecord:
    """One run of :func:`~criticalkv.bench.plan.plan_runs`'s plan on the (B, T) prompt ``ids``, measured
    by its implementation (ours, the full cache, or kvpress's press on ``kvpress_model``)."""
    window, steps = config.window, config.decode_tokens
    if run.impl == "kvpress" and run.decode is not None:
        return measure_kvpress_decode(
            kvpress,
            kvpress_model,
            ids,
            run.method,
            run.budget,
            window,
            steps,
            decode_budget=run.decode.budget,
            decode_interval=run.decode.interval,
        )
    if run.impl == "kvpress":
        return measure_kvpress(
            kvpress, kvpress_model, ids, run.method, float(run.budget), window, steps, storage=run.storage
        )
    if run.method == "full":
        return measure_full(model, ids, steps)
    spec = bind_spec(run.spec, model, config.head_scores)
    return measure_criticalkv(
        model, ids, spec.with_method(with_norm_precision(spec.method, config.norm_precision)), steps
    )


def _fastest(tries: Sequence[BenchRecord]) -> BenchRecord:
    best = copy.copy(tries[0])
    if len(tries) == 1:
        return best
    best.prefill_s = min(t.prefill_s for t in tries)
    best.compress_s = min(t.compress_s for t in tries)
    best.ttft_s = min(t.ttft_s for t in tries)
    best.decode_ms_per_token = min(t.decode_ms_per_token for t in tries)
    best.tokens_per_s = max(t.tokens_per_s for t in tries)
    peaks = [t.peak_rss_bytes for t in tries if t.peak_rss_bytes is not None]
    best.peak_rss_bytes = max(peaks) if peaks else None
    return best
