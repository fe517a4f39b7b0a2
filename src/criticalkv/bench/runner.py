"""Run the benchmark grid: (context length x batch size) x (full, methods x budgets) x implementations."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from criticalkv.bench.kvpress_impl import import_kvpress, kvpress_supports, measure_kvpress
from criticalkv.bench.ours import measure_criticalkv, measure_full
from criticalkv.bench.prompt import bench_prompts
from criticalkv.bench.record import BenchRecord
from criticalkv.budgets.resolve import Budget, resolve_budget, validate_budget
from criticalkv.cache.compressed_cache import check_window
from criticalkv.cache.decode_compression import DEFAULT_INTERVAL, check_decode_budget
from criticalkv.methods import Method, bind, get_method
from criticalkv.runtime.forward import input_device
from criticalkv.scores.value_norms import NORM_PRECISIONS

logger = logging.getLogger(__name__)

KVPRESS_CHOICES = ("auto", "on", "off")


@dataclass
class BenchConfig:
    """What :func:`run_bench` measures.

    ``kvpress``: ``"auto"`` compares with kvpress when it can be imported, ``"on"`` requires
    it, ``"off"`` skips it. ``full`` (transformers' dynamic cache) is always measured: it is
    the reference of every ratio. ``head_scores``: a head-score file for head-prior methods
    (``headkv``, ``critical-headkv``) instead of the model's own. ``decode_budget``: hold each
    method's cache at that many entries per KV head while it decodes, re-selecting every
    ``decode_interval`` new entries per head (kvpress is then not compared: ``"auto"`` skips it).
    """

    context_lengths: list[int] = field(default_factory=lambda: [4096])
    methods: list[str] = field(default_factory=lambda: ["snapkv", "critical-snapkv", "adakv", "critical-adakv"])
    budgets: list[Budget] = field(default_factory=lambda: [0.2])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    decode_tokens: int = 32
    window: int = 32
    kvpress: str = "auto"
    repeats: int = 1
    norm_precision: str | None = None
    head_scores: str | Path | None = None
    decode_budget: int | None = None
    decode_interval: int = DEFAULT_INTERVAL

    def __post_init__(self) -> None:
        self.methods = [get_method(m).name for m in self.methods if m != "full"]
        self.budgets = [validate_budget(b) for b in self.budgets]
        check_window(self.window)
        if not self.context_lengths or any(n <= self.window for n in self.context_lengths):
            raise ValueError(f"context lengths must be longer than the window ({self.window} tokens)")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError("batch sizes must be positive integers")
        if self.decode_tokens < 1:
            raise ValueError("decode_tokens must be at least 1")
        if self.repeats < 1:
            raise ValueError("repeats must be at least 1")
        if self.norm_precision is not None and self.norm_precision not in NORM_PRECISIONS:
            raise ValueError(f"norm precision must be one of {', '.join(NORM_PRECISIONS)}, not {self.norm_precision!r}")
        if self.kvpress not in KVPRESS_CHOICES:
            raise ValueError(f"kvpress must be one of {', '.join(KVPRESS_CHOICES)}, not {self.kvpress!r}")
        if self.decode_budget is not None:
            self._check_decode()
        for length in self.context_lengths:  # every (length, budget) resolves before anything is measured
            for budget in self.budgets:
                try:
                    resolve_budget(budget, torch.tensor([length]), self.window)
                except ValueError as err:
                    raise ValueError(f"--budgets {budget} at --context-lengths {length}: {err}") from None

    def _check_decode(self) -> None:
        if self.kvpress == "on":
            raise ValueError(
                "kvpress is not measured under a decode budget (its presses compress the prompt only); "
                "drop kvpress='on' (--kvpress) or the decode budget"
            )
        if not self.methods:
            raise ValueError("a decode budget needs at least one compressing method besides full")
        for name in self.methods:
            check_decode_budget(get_method(name), self.window, self.decode_budget, self.decode_interval)

    @property
    def decode(self) -> tuple[int, int] | None:
        """(decode budget, interval), or ``None`` without a decode budget."""
        return None if self.decode_budget is None else (self.decode_budget, self.decode_interval)

    def check_model(self, model: Any) -> None:
        limit = getattr(model.config, "max_position_embeddings", None)
        longest = max(self.context_lengths) + self.decode_tokens + 1
        if limit is not None and longest > limit:
            raise ValueError(
                f"the model takes at most {limit} positions; the longest context plus decode tokens needs {longest} "
                "(lower --context-lengths or --decode-tokens)"
            )
        for name in self.methods:  # head scores found and fitting the model, before anything is measured
            bind(get_method(name), model, self.head_scores)


def with_norm_precision(method: Method, precision: str | None) -> Method:
    """``method`` with its selection's value-norm precision set (methods without one unchanged)."""
    return method.with_norm_precision(precision)


def record_key(record: BenchRecord | dict[str, Any]) -> str:
    """What identifies a record in ``records.jsonl`` (the decode settings only when set)."""
    data = record.to_dict() if isinstance(record, BenchRecord) else record
    budget_d = data.get("decode_budget")
    decode = None if budget_d is None else (int(budget_d), int(data["decode_interval"]))
    return _key(data["impl"], data["method"], data["context_tokens"], data["budget"], data["batch_size"], decode)


def _key(impl: str, method: str, length: int, budget: Budget, batch: int, decode: tuple[int, int] | None) -> str:
    base = f"{impl}|{method}|{length}|{float(budget)}|{batch}"
    return base if decode is None else f"{base}|decode={decode[0]}/{decode[1]}"


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
) -> list[BenchRecord]:
    """Measure every configuration of ``config``; returns the records (in measurement order).

    ``kvpress_model`` is a second, plain copy of the model for kvpress (its presses hook the
    model's attention modules; criticalkv's model is attached to our attention function).
    With ``out``, each record is appended to ``out/records.jsonl`` as soon as it is measured,
    and configurations already there are skipped (an interrupted run resumes).
    With ``repeats > 1`` each configuration is measured that many times and the fastest
    prefill, compression and decode are kept (the usual way to discount machine noise).
    """
    config.check_model(model)
    kvpress = None
    if config.kvpress != "off" and config.decode_budget is None:
        kvpress = import_kvpress()
        if kvpress is None and config.kvpress == "on":
            raise ValueError(
                "kvpress is not importable here; install it with: pip install 'criticalkv[bench]' "
                "(kvpress 0.5.5 needs transformers < 5.3)"
            )
        if kvpress is not None and kvpress_model is None:
            raise ValueError("comparing with kvpress needs kvpress_model, a second copy of the model")
    device = input_device(model)
    done: set[str] = set()
    records_path = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        records_path = out / "records.jsonl"
        _drop_torn_tail(records_path)
        done = {record_key(r) for r in load_records(records_path)}
    plan: list[tuple[str, str, int, Budget, int]] = []
    for length in config.context_lengths:
        for batch in config.batch_sizes:
            plan.append(("criticalkv", "full", length, 1.0, batch))
            for budget in config.budgets:
                for method in config.methods:
                    plan.append(("criticalkv", method, length, budget, batch))
                    if kvpress is not None and kvpress_supports(method) and isinstance(budget, float):
                        plan.append(("kvpress", method, length, budget, batch))  # kvpress takes fractions only
    # a token count is recorded (and keyed) as a float above 1, as records always held budgets;
    # the full cache keeps everything, so it is the same record with or without a decode budget
    todo = [p for p in plan if _key(*p, None if p[1] == "full" else config.decode) not in done]
    records: list[BenchRecord] = []
    if not todo:
        return records
    _warm_up(model, device, bench_prompts(tokenizer, 64, 1))
    if kvpress is not None and kvpress_model is not None:
        _warm_up(kvpress_model, device, bench_prompts(tokenizer, 64, 1))
    prompts: dict[tuple[int, int], torch.Tensor] = {}
    for impl, method, length, budget, batch in tqdm(todo, desc="bench", unit="run"):
        ids = prompts.get((length, batch))
        if ids is None:
            ids = prompts[(length, batch)] = bench_prompts(tokenizer, length, batch).to(device)
        tries = []
        for _ in range(config.repeats):
            if impl == "kvpress":
                tries.append(
                    measure_kvpress(
                        kvpress, kvpress_model, ids, method, float(budget), config.window, config.decode_tokens
                    )
                )
            elif method == "full":
                tries.append(measure_full(model, ids, config.decode_tokens))
            else:
                chosen = with_norm_precision(bind(get_method(method), model, config.head_scores), config.norm_precision)
                tries.append(
                    measure_criticalkv(
                        model,
                        ids,
                        chosen,
                        budget,
                        config.window,
                        config.decode_tokens,
                        decode_budget=config.decode_budget,
                        decode_interval=config.decode_interval,
                    )
                )
        record = _fastest(tries)
        records.append(record)
        if records_path is not None:
            _append(records_path, record)
        if on_record is not None:
            on_record(record)
    return records


def _fastest(tries: Sequence[BenchRecord]) -> BenchRecord:
    best = tries[0]
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
