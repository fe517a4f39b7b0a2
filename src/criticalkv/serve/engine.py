"""The engine: the model, the context store and the one worker thread that does all model work.

Requests are admitted up to ``max_sessions`` at once (one more is a 429), queued, and run by
a worker thread, so the event loop never waits on the model. The worker batches continuously:
between two decode steps it starts what arrived while fewer than ``max_batch`` answers are
being decoded (compressing a context, or a question's fork, prefill and first token), drops
the answers that finished or whose client went away (freeing their forks), and then advances
every remaining answer by one token in one batched forward (:func:`criticalkv.runtime.decode_rows`):
the rows may come from different contexts, lengths, methods and budgets, and each decodes
exactly as it would alone. A long answer does not hold back the first token of a new one.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.methods import bind, get_method
from criticalkv.prompts import encode_pair
from criticalkv.runtime import attach, decode_rows, eos_ids, input_device, prefill_into
from criticalkv.serve.config import ServerConfig
from criticalkv.serve.errors import APIError
from criticalkv.serve.metrics import Metrics
from criticalkv.serve.session import Channel, ChatWork, Session
from criticalkv.serve.store import ContextStore

logger = logging.getLogger(__name__)

#: a question stands in for the one a stored context will get (its prefix does not depend on it)
_ANY_QUESTION = "?"
_ANY_CONTEXT = "."


class Engine:
    """Model work for the server: stored contexts, chat sessions, the worker thread."""

    def __init__(self, model: Any, tokenizer: Any, config: ServerConfig) -> None:
        attach(model)
        self.model: Any = model
        self.tokenizer = tokenizer
        self.tokenizer_lock = threading.Lock()
        self.config = config
        self.eos = eos_ids(model, tokenizer)
        self._tempdir = None if config.store else tempfile.TemporaryDirectory(prefix="criticalkv-store-")
        folder = Path(config.store) if config.store else Path(self._tempdir.name)  # type: ignore[union-attr]
        self.store = ContextStore(folder, config.memory_cap_bytes, model, tokenizer)
        self.metrics = Metrics()
        self.max_positions = int(getattr(model.config, "max_position_embeddings", None) or 2**31)
        #: (bytes of the stored context it will read, 0 if none; the job), in arrival order
        self._jobs: queue.Queue[tuple[int, Callable[[], Session | None]]] = queue.Queue()
        self._waiting: tuple[int, Callable[[], Session | None]] | None = None  # next, until its row fits
        self._admitted = 0
        self._admit_lock = threading.Lock()
        self._active: list[Session] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="criticalkv-worker", daemon=True)

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self._tempdir is not None:
            self._tempdir.cleanup()

    # --- tokens (cheap; callers validate with them before admission) --------------------------
    def context_ids(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return encode_pair(self.tokenizer, text, _ANY_QUESTION)[0]

    def question_ids(self, question: str) -> list[int]:
        with self.tokenizer_lock:
            return encode_pair(self.tokenizer, _ANY_CONTEXT, question)[1]

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A whole conversation, rendered with the chat template (or plain text without one)."""
        with self.tokenizer_lock:
            if isinstance(self.tokenizer.chat_template, str):
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            else:
                text = "\n\n".join(m["content"] for m in messages) + "\nAnswer:"
            return list(self.tokenizer(str(text), add_special_tokens=False)["input_ids"])

    # --- admission ----------------------------------------------------------------------------
    def admit(self) -> None:
        with self._admit_lock:
            if self._admitted >= self.config.max_sessions:
                self.metrics.request(rejected=True)
                raise APIError(
                    429,
                    f"the server is answering its limit of {self.config.max_sessions} requests; retry shortly",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                )
            self._admitted += 1
        self.metrics.request()

    def _release(self) -> None:
        with self._admit_lock:
            self._admitted -= 1

    def queue_depth(self) -> int:
        return self._jobs.qsize() + (self._waiting is not None)

    def active(self) -> int:
        return len(self._active)

    # --- submitting work (from the event loop) -----------------------------------------------
    def submit_context(self, ids: list[int], method: str, budget: float, window: int, channel: Channel) -> None:
        """Compress ``ids`` (a context, question-agnostic) and store it; answers ``("done", info)``."""

        def job() -> None:
            try:
                entry = self._compress(ids, method, budget, window)
                channel.put("done", entry.info())
            finally:
                self._release()

        self._submit(job, channel, 0)

    def submit_chat(self, work: ChatWork, channel: Channel) -> None:
        """Answer ``work``; streams ``("delta", text)`` items, then ``("done", summary)``."""

        def job() -> Session | None:
            session = Session(self, work, channel)
            try:
                session.start()
            except BaseException:
                self._release()
                raise
            if session.done:
                self._release()
                return None
            return session

        context_bytes = 0
        if work.context_id is not None:
            with contextlib.suppress(APIError):  # deleted meanwhile: the job answers 404 itself
                context_bytes = int(self.store.info(work.context_id)["kv_bytes"])
        self._submit(job, channel, context_bytes)

    def _submit(self, job: Callable[[], Session | None], channel: Channel, context_bytes: int) -> None:
        def guarded() -> Session | None:
            try:
                return job()
            except APIError as error:
                channel.put("error", error)
            except Exception as error:
                logger.exception("request failed in the worker")
                channel.put("error", APIError(500, f"the server failed on this request: {error}", type="server_error"))
            return None

        self._jobs.put((context_bytes, guarded))

    @torch.no_grad()
    def _compress(self, ids: list[int], method: str, budget: float, window: int) -> Any:
        cache = CompressedCache(
            self.model.config.num_hidden_layers, bind(get_method(method), self.model), budget, window
        )
        tensor = torch.tensor([ids], dtype=torch.long, device=input_device(self.model))
        prefill_into(self.model, cache, tensor, torch.ones_like(tensor))
        return self.store.add(cache, len(ids), method, budget, window)

    # --- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._start_arrivals()
            self._drop_finished()
            if self._active:
                self._decode_step()

    def _start_arrivals(self) -> None:
        """Run queued jobs in order while fewer than ``max_batch`` answers decode and the next
        one's context fits in the memory cap beside theirs (waiting briefly when idle)."""
        while len(self._active) < self.config.max_batch:
            if self._waiting is None:
                try:
                    self._waiting = self._jobs.get(timeout=0.05) if not self._active else self._jobs.get_nowait()
                except queue.Empty:
                    return
            context_bytes, job = self._waiting
            if self._active and self.rows_bytes() + context_bytes > self.config.memory_cap_bytes:
                return  # it starts once rows that hold memory have left
            self._waiting = None
            session = job()
            if session is not None:
                self._active.append(session)

    def rows_bytes(self) -> int:
        """KV bytes the answers being decoded hold: each stored context they read once, plus
        every row's own tail (or its whole cache, for a prompt compressed for the request)."""
        contexts: dict[str, int] = {}
        own = 0
        for session in self._active:
            if session.cache is None:
                continue
            held = session.cache.kv_bytes()
            if session.work.context_id is not None:
                contexts[session.work.context_id] = session.context_bytes
                held -= session.context_bytes
            own += held
        return own + sum(contexts.values())

    def _drop_finished(self) -> None:
        for session in [s for s in self._active if not s.pending()]:
            self._active.remove(session)
            session.cache = None
            self._release()

    def _decode_step(self) -> None:
        """One token for every active answer, in one batched forward."""
        rows = list(self._active)
        try:
            logits = decode_rows(self.model, [s.cache for s in rows], [s.next_token for s in rows])  # type: ignore[misc]
        except Exception as error:
            logger.exception("decoding failed")
            for session in rows:
                session.channel.put("error", APIError(500, f"decoding failed: {error}", type="server_error"))
                session.done = True
            self._drop_finished()
            return
        self.metrics.decode_step(len(rows))
        for session, row in zip(rows, logits, strict=True):
            session.advance(row)
