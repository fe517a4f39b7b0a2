"""The compression thread: documents posted to the server, and long chat prompts
(:mod:`~criticalkv.serve.prompt_queue`), are compressed beside the decode steps.

Compressing a long document or prompt is one long prefill. Run on the decode worker it would hold back
the next token of every answer being decoded until it ends; run here, on a thread of its own
(one compression at a time, in arrival order), it shares the cores with the decode steps, which
go on. Model forwards from two threads are safe: a criticalkv cache hands its layer to the
attention function through a context variable (:mod:`criticalkv.cache.routing`), per thread,
and every request has its own cache.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Compressor:
    """One thread running queued jobs (each answers its own request) until :meth:`stop`."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], object]] = queue.Queue()
        self._running = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="criticalkv-compressor", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def submit(self, job: Callable[[], object]) -> None:
        self._jobs.put(job)

    def pending(self) -> int:
        """Jobs queued or running."""
        return self._jobs.qsize() + self._running

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            self._running = 1
            try:
                job()
            except Exception:  # a job answers its own errors; one that did not must not end the thread
                logger.exception("a compression job failed")
            finally:
                self._running = 0
