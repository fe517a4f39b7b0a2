"""Long chat prompts compressed on the compression thread, beside the decode steps.

A chat without ``context_id`` sends its whole prompt; compressing a long one is one long
prefill. Run on the decode worker it would hold back the next token of every answer being
decoded until it ends; so the worker hands a prompt of at least ``offload_prompt_tokens`` tokens
to the compression thread (:class:`~criticalkv.serve.compressor.Compressor`, shared with posted
documents, in arrival order) and goes on decoding. When the compression ends, the worker takes
the cache and the first token's logits between two decode steps and the answer joins the batch.
A shorter prompt stays on the worker: its prefill costs about a decode step or less, and on the
compression thread it could wait behind a long document.

Only the worker touches :attr:`PromptCompressions.sessions` and the sessions themselves; the
compression thread only computes ``Session.compress_prompt()`` and hands the outcome back.
A client that goes away stops its prefill at the next decoder layer
(:mod:`~criticalkv.serve.cancel`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from criticalkv.serve.cancel import Cancelled, cancellable, watch_layers
from criticalkv.serve.compressor import Compressor
from criticalkv.serve.errors import APIError, server_error
from criticalkv.serve.session import Session

logger = logging.getLogger(__name__)

#: what a compression hands back: the cache and the (V,) logits after the prompt, or its error
Outcome = tuple[Any, Any] | Exception


class PromptCompressions:
    """Prompts handed to the compression thread and not yet taken back by the worker."""

    def __init__(self, compressor: Compressor, model: Any) -> None:
        watch_layers(model)
        self.compressor = compressor
        self.sessions: list[Session] = []  # being compressed (or queued for it), in hand-off order
        self._done: queue.Queue[tuple[Session, Outcome]] = queue.Queue()
        self._ended = threading.Event()

    def submit(self, session: Session) -> None:
        """(The worker) Compress ``session``'s prompt on the compression thread."""
        session.compressing = True
        self.sessions.append(session)

        def job() -> None:
            outcome: Outcome
            if session.cancelled():
                outcome = Cancelled("the client went away before its prompt was compressed")
            else:
                try:
                    with cancellable(session.channel.cancelled):
                        outcome = session.compress_prompt()
                except Exception as error:  # the worker answers it on the request's channel
                    outcome = error
            self._done.put((session, outcome))
            self._ended.set()

        self.compressor.submit(job)

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
