"""The server's counters, rendered in the Prometheus text exposition format."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

#: tokens per second are measured over this many recent seconds
RATE_WINDOW_S = 30.0

#: one metric of the exposition: (name, type, help text, value)
_Row = tuple[str, str, str, Any]


class Metrics:
    """Counters the worker updates and ``/metrics`` reads (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tokens_total = 0
        self.requests_total = 0
        self.rejected_total = 0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.last_ttft = 0.0
        self.decode_steps_total = 0
        self.decode_rows_total = 0
        self.decode_rows_max = 0
        self.decode_rows_last = 0
        self.start_steps_total = 0
        self.start_rows_total = 0
        self.start_rows_max = 0
        self.prompt_batches_total = 0
        self.prompt_batch_rows_total = 0
        self.prompt_batch_rows_max = 0
        self.row_bytes: list[tuple[str, int]] = []  # (stored context or "", own KV bytes) per decode row
        self.rows_bytes = 0  # the rows' own bytes plus each stored context they read, once
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent decode steps

    def token(self, count: int = 1) -> None:
        now = time.monotonic()
        with self._lock:
            self.tokens_total += count
            self._recent.append((now, count))
            self._trim(now)

    def decode_step(self, rows: int) -> None:
        """One batched decode step over ``rows`` answers (one token each)."""
        with self._lock:
            self.decode_steps_total += 1
            self.decode_rows_total += rows
            self.decode_rows_max = max(self.decode_rows_max, rows)
            self.decode_rows_last = rows

    def start_step(self, rows: int) -> None:
        """One batched start: the questions of ``rows`` answers appended in one forward."""
        with self._lock:
            self.start_steps_total += 1
            self.start_rows_total += rows
            self.start_rows_max = max(self.start_rows_max, rows)

    def prompt_batch(self, rows: int) -> None:
        """One compression of ``rows`` prompts in one batched prefill (the compression thread)."""
        with self._lock:
            self.prompt_batches_total += 1
            self.prompt_batch_rows_total += rows
            self.prompt_batch_rows_max = max(self.prompt_batch_rows_max, rows)

    def rows(self, sessions: Sequence[Any], total: int) -> None:
        """What the decode rows hold now: each row's own KV bytes, and ``total`` (with the stored
        contexts they read, each once); the worker publishes it after every change."""
        held = [(s.work.context_id or "", s.own_bytes()) for s in sessions if s.cache is not None]
        with self._lock:
            self.row_bytes, self.rows_bytes = held, total

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1
            self.last_ttft = seconds

    def request(self, rejected: bool = False) -> None:
        with self._lock:
            self.requests_total += 1
            self.rejected_total += int(rejected)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self, store: dict[str, int], queue_depth: int, active: int) -> str:
        """The exposition text: counters of this object beside the store's and queue's gauges."""
        rate = self.tokens_per_second()
        with self._lock:
            rows = _gauges(store, queue_depth, active) + self._counters(rate)
            lines = _exposition(rows) + self._row_lines() + self._ttft_lines()
        return "\n".join(lines) + "\n"

    def _counters(self, rate: float) -> list[_Row]:
        """This object's counters and gauges as (name, type, help, value); the caller holds the lock."""
        return [
            ("criticalkv_decode_steps_total", "counter", "batched decode steps", self.decode_steps_total),
            ("criticalkv_decode_rows_total", "counter", "rows over all decode steps", self.decode_rows_total),
            ("criticalkv_decode_rows_max", "gauge", "the most rows one decode step held", self.decode_rows_max),
            ("criticalkv_decode_rows_last", "gauge", "rows of the last decode step", self.decode_rows_last),
            (
                "criticalkv_start_steps_total",
                "counter",
                "batched question appends",
                self.start_steps_total,
            ),
            ("criticalkv_start_rows_total", "counter", "answers over all batched starts", self.start_rows_total),
            ("criticalkv_start_rows_max", "gauge", "the most answers one batched start held", self.start_rows_max),
            (
                "criticalkv_prompt_batches_total",
                "counter",
                "prompt compressions (batched prefills)",
                self.prompt_batches_total,
            ),
            (
                "criticalkv_prompt_batch_rows_total",
                "counter",
                "prompts over all prompt compressions",
                self.prompt_batch_rows_total,
            ),
            (
                "criticalkv_prompt_batch_rows_max",
                "gauge",
                "the most prompts one prefill compressed",
                self.prompt_batch_rows_max,
            ),
            (
                "criticalkv_rows_kv_bytes",
                "gauge",
                "KV bytes the decode rows hold (their own plus each stored context they read, once)",
                self.rows_bytes,
            ),
            (
                "criticalkv_rows_context_kv_bytes",
                "gauge",
                "KV bytes of the stored contexts the decode rows read, each once",
                self.rows_bytes - sum(n for _, n in self.row_bytes),
            ),
            ("criticalkv_generated_tokens_total", "counter", "tokens generated", self.tokens_total),
            (
                "criticalkv_tokens_per_second",
                "gauge",
                f"tokens generated per second over {RATE_WINDOW_S:g} s",
                rate,
            ),
            ("criticalkv_requests_total", "counter", "requests admitted or rejected", self.requests_total),
            ("criticalkv_rejected_total", "counter", "requests rejected with 429", self.rejected_total),
            (
                "criticalkv_time_to_first_token_seconds_last",
                "gauge",
                "time to first token of the last answer",
                self.last_ttft,
            ),
        ]

    def _row_lines(self) -> list[str]:
        """Each decode row's own KV bytes, labelled by row and context; the caller holds the lock."""
        name = "criticalkv_row_kv_bytes"
        lines = [
            f"# HELP {name} KV bytes each decode row holds of its own (its fork's tail)",
            f"# TYPE {name} gauge",
        ]
        lines += [f'{name}{{row="{r}",context="{c}"}} {n}' for r, (c, n) in enumerate(self.row_bytes)]
        return lines

    def _ttft_lines(self) -> list[str]:
        """The time-to-first-token summary; the caller holds the lock."""
        name = "criticalkv_time_to_first_token_seconds"
        return [
            f"# HELP {name} time from admission to the first token",
            f"# TYPE {name} summary",
            f"{name}_sum {self.ttft_sum}",
            f"{name}_count {self.ttft_count}",
        ]


def _gauges(store: dict[str, int], queue_depth: int, active: int) -> list[_Row]:
    """The store's, the queue's and the sessions' gauges."""
    return [
        ("criticalkv_contexts_in_memory", "gauge", "stored contexts held in memory", store["in_memory"]),
        ("criticalkv_contexts_on_disk", "gauge", "stored contexts in the store folder", store["on_disk"]),
        (
            "criticalkv_context_bytes_in_memory",
            "gauge",
            "KV bytes of contexts in memory",
            store["bytes_in_memory"],
        ),
        ("criticalkv_context_bytes_total", "gauge", "KV bytes of every stored context", store["bytes_total"]),
        (
            "criticalkv_context_bytes_full_total",
            "gauge",
            "KV bytes the stored contexts would take uncompressed",
            store["bytes_full_total"],
        ),
        ("criticalkv_memory_cap_bytes", "gauge", "cap on KV bytes of contexts in memory", store["cap_bytes"]),
        ("criticalkv_queue_depth", "gauge", "admitted requests waiting for the worker", queue_depth),
        ("criticalkv_sessions_active", "gauge", "requests being decoded", active),
    ]


def _exposition(rows: Sequence[_Row]) -> list[str]:
    """HELP, TYPE and value lines of each metric."""
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return lines
