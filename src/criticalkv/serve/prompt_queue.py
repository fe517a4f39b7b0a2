"""Long chat prompts compressed on the compression thread, beside the decode steps.

A chat without ``context_id`` sends its whole prompt; compressing a long one is one long
prefill. Run on the decode worker it would hold back the next token of every answer being
decoded until it ends; so the worker hands a prompt of at least ``offload_prompt_tokens`` tokens
to the compression thread (:class:`~criticalkv.serve.compressor.Compressor`, shared with posted
documents, in arrival order) and goes on decoding. When the compression ends, the worker takes
the cache and the first token's logits between two decode steps and the answer joins the batch.
Prompts that arrive together are compressed together, in one left-padded prefill
(:func:`~criticalkv.serve.compress.compress_rows`), and their answers join the decode batch in
the same step. A shorter prompt stays on the worker: its prefill costs about a decode step or less, and on the
compression thread it could wait behind a long document.

Only the worker touches :attr:`PromptCompressions.sessions` and the sessions themselves; the
compression thread only compresses the queued prompts and hands the outcomes back. A client that
goes away stops its prefill at the next decoder layer (:mod:`~criticalkv.serve.cancel`); in a
batch, once every one of the batch's clients has gone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from criticalkv.serve.cancel import Cancelled, cancellable, watch_layers
from criticalkv.serve.compress import compress_rows
from criticalkv.serve.compressor import Compressor
from criticalkv.serve.errors import APIError, server_error
from criticalkv.serve.session import Session

logger = logging.getLogger(__name__)

#: what a compression hands back: the cache and the (V,) logits after the prompt, or its error
Outcome = tuple[Any, Any] | Exception


class AllCancelled:
    """Set once every request of a batch has been cancelled (its clients all went away): the
    batch's prefill then stops at its next layer; while one client waits it goes on."""

    def __init__(self, sessions: list[Session]) -> None:
        self.sessions = sessions

    def is_set(self) -> bool:
        return all(session.cancelled() for session in self.sessions)


class PromptQueue:
    """Prompts not yet taken by a compression job, taken in batches that share one prefill: the
    oldest and, beside it, the queued prompts with its batch key
    (:meth:`~criticalkv.serve.session.Session.batch_key`), in arrival order, while the padded batch
    holds at most ``batch_tokens`` tokens and ``max_rows`` prompts (the worker puts, the
    compression thread takes: a lock)."""

    def __init__(self, batch_tokens: int, max_rows: int) -> None:
        self.batch_tokens, self.max_rows = batch_tokens, max_rows
        self._queued: list[Session] = []
        self._lock = threading.Lock()

    def put(self, session: Session) -> None:
        with self._lock:
            self._queued.append(session)

    def take_batch(self) -> list[Session]:
        """The next batch (empty if nothing is queued)."""
        with self._lock:
            if not self._queued:
                return []
            batch = [self._queued[0]]
            key, width = batch[0].batch_key(), len(batch[0].work.prompt_ids)
            for session in self._queued[1:] if key is not None else ():
                if len(batch) == self.max_rows:
                    break
                if session.batch_key() != key:
                    continue
                wider = max(width, len(session.work.prompt_ids))
                if wider * (len(batch) + 1) > self.batch_tokens:
                    break  # the next prompt of this key waits for the next batch: the order holds
                batch.append(session)
                width = wider
            self._queued = [s for s in self._queued if not any(s is taken for taken in batch)]
            return batch


class PromptCompressions:
    """Prompts handed to the compression thread and not yet taken back by the worker.

    Prompts queued together are compressed together: each compression job takes the next batch
    of its :class:`PromptQueue`. A job that finds the compressor idle first waits ``gather_s``
    seconds for prompts sent at the same moment to arrive.
    """

    def __init__(
        self, compressor: Compressor, model: Any, batch_tokens: int = 4096, max_rows: int = 8, gather_s: float = 0.05
    ) -> None:
        watch_layers(model)
        self.compressor = compressor
        self.queue = PromptQueue(batch_tokens, max_rows)
        self.gather_s = gather_s
        self.on_batch: Callable[[int], None] | None = None  # told each batch's rows (the server's metrics)
        self.sessions: list[Session] = []  # being compressed (or queued for it), in hand-off order
        self._done: queue.Queue[tuple[Session, Outcome]] = queue.Queue()
        self._ended = threading.Event()
        self._last_end = float("-inf")  # when the last batch's compression ended (the compression thread)

    def submit(self, session: Session) -> None:
        """(The worker) Compress ``session``'s prompt on the compression thread."""
        session.compressing = True
        self.sessions.append(session)
        self.queue.put(session)
        self.compressor.submit(self._compress_next)

    def _compress_next(self) -> None:
        """(The compression thread) Compress the next batch of queued prompts, if any is left."""
        if time.monotonic() - self._last_end > self.gather_s:  # it was idle: more may be on their way
            time.sleep(self.gather_s)  # prompts sent together arrive a few milliseconds apart
        batch = self.queue.take_batch()
        if not batch:
            return  # an earlier job took this one's prompt into its batch
        if self.on_batch is not None:
            self.on_batch(len(batch))
        outcomes = self._outcomes(batch)
        self._last_end = time.monotonic()
        for session, outcome in zip(batch, outcomes, strict=True):
            self._done.put((session, outcome))
        self._ended.set()

    @staticmethod
    def _outcomes(batch: list[Session]) -> list[Outcome]:
        """Each prompt's cache and logits (or the error, or :class:`Cancelled` for a client gone)."""
        live = [session for session in batch if not session.cancelled()]
        gone: Outcome = Cancelled("the client went away before its prompt was compressed")
        done: dict[int, Outcome] = {id(session): gone for session in batch}
        if live:
            outcomes: list[Outcome]
            try:
                with cancellable(AllCancelled(live)):  # type: ignore[arg-type]
                    outcomes = [live[0].compress_prompt()] if len(live) == 1 else compress_sessions(live)
            except Exception as error:  # the worker answers it on each request's channel
                outcomes = [error] * len(live)
            done.update({id(session): outcome for session, outcome in zip(live, outcomes, strict=True)})
        return [done[id(session)] for session in batch]

    def take(self, release: Callable[[], None]) -> list[Session]:
        """(The worker) The sessions whose compression ended since the last call, each with its
        cache and first token, ready to decode; a compression that failed answers its error, one
        whose client went away ends silently, and both ``release`` their admission."""
        self._ended.clear()
        ready: list[Session] = []
        while True:
            try:
                session, outcome = self._done.get_nowait()
            except queue.Empty:
                return ready
            self.sessions.remove(session)
            session.compressing = False
            if isinstance(outcome, Exception):
                if not isinstance(outcome, Cancelled):
                    if not isinstance(outcome, APIError):
                        logger.error("compressing a prompt failed", exc_info=outcome)
                    session.channel.put("error", server_error(outcome))
                release()
                continue
            session.cache, logits = outcome
            session.first(logits)  # a finished or cancelled one leaves at the worker's next drop
            ready.append(session)

    def wait(self, timeout: float) -> None:
        """(The worker, when it has nothing to decode) Until a compression ends, or ``timeout`` s."""
        self._ended.wait(timeout)


def compress_sessions(sessions: list[Session]) -> list[Outcome]:
    """The prompts of ``sessions`` (one :meth:`~criticalkv.serve.session.Session.batch_key`)
    compressed in one batched prefill, each its own cache and first logits."""
    key = sessions[0].batch_key()
    if key is None or any(session.batch_key() != key for session in sessions):
        raise ValueError("only prompts with one batch key (method, budget, window) are compressed together")
    rows = [session.work.prompt_ids for session in sessions]
    return list(compress_rows(sessions[0].engine.model, rows, sessions[0].work.spec))
