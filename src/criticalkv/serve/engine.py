"""The engine: the model, the context store, the decode worker and the compression thread.

Requests are admitted up to ``max_sessions`` at once (one more is a 429), queued, and run by
worker threads, so the event loop never waits on the model. A posted document, and the prompt
of a chat without ``context_id`` of at least ``offload_prompt_tokens`` tokens, are compressed on
the compression thread (:class:`~criticalkv.serve.compressor.Compressor`,
:mod:`~criticalkv.serve.prompt_queue`), beside the decode steps, so a long prefill does not stall
the answers being decoded. The decode worker batches continuously: between two decode steps it
takes the prompts whose compression ended (their first token), starts what arrived while fewer
than ``max_batch`` answers are being decoded or compressed (a short prompt's prefill and first
token, or a fork of a stored context: the questions of every answer on a stored context that
starts in the same step are appended in one batched forward,
:func:`criticalkv.runtime.append_rows`), drops the answers that finished or whose client went
away (freeing their forks), and then advances every remaining answer by one token in one
batched forward (:func:`criticalkv.runtime.decode_rows`): the rows may come from different
contexts, lengths, methods and budgets, and each decodes exactly as it would alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from criticalkv.cache import CacheSpec, bind_spec
from criticalkv.prompts import encode_pair
from criticalkv.runtime import append_rows, attach, compresses_in_prefill, decode_rows, eos_ids, repeat_prompt
from criticalkv.serve.cancel import Cancelled, Progress, cancellable
from criticalkv.serve.compress import check_methods, compress
from criticalkv.serve.compressor import Compressor
from criticalkv.serve.config import ServerConfig
from criticalkv.serve.conversation import conversation_ids
from criticalkv.serve.errors import APIError, server_error
from criticalkv.serve.metrics import Metrics
from criticalkv.serve.prompt_queue import PromptCompressions
from criticalkv.serve.row_memory import answer_reserve, held_bytes, token_bytes
from criticalkv.serve.session import Channel, ChatWork, Session
from criticalkv.serve.store import ContextStore

logger = logging.getLogger(__name__)

#: a question stands in for the one a stored context will get (its prefix does not depend on it)
_ANY_QUESTION = "?"
_ANY_CONTEXT = "."


@dataclass(frozen=True)
class Job:
    """Queued work: what it will hold in memory once it decodes, and the work itself."""

    run: Callable[[], Session | None]
    context_id: str | None = None  # the stored context it reads (shared by the rows that read it)
    context_bytes: int = 0
    reserve: int = 0  # the most KV bytes of its own the answer may hold (its tail, or its prompt)


class Engine:
    """Model work for the server: stored contexts, chat sessions, the worker thread.

    Raises ``ValueError`` up front if the storage options do not suit ``model`` or a served
    method cannot be bound to it (``headkv`` without head scores for it).
    """

    def __init__(self, model: Any, tokenizer: Any, config: ServerConfig) -> None:
        check_methods(model, config.allowed_methods())
        bind_spec(config.spec, model)  # the storage's group size against the model's head dimension
        attach(model)
        self.model: Any = model
        self.tokenizer = tokenizer
        self.tokenizer_lock = threading.Lock()
        self.config = config
        self.eos = eos_ids(model, tokenizer)
        self.repeat = repeat_prompt(tokenizer)  # KVzip's reconstruction pass (contexts are encoded as chat)
        self._tempdir = None if config.store else tempfile.TemporaryDirectory(prefix="criticalkv-store-")
        folder = Path(config.store) if config.store else Path(self._tempdir.name)  # type: ignore[union-attr]
        self.store = ContextStore(folder, config.memory_cap_bytes, model, tokenizer)
        self.metrics = Metrics()
        self.max_positions = int(getattr(model.config, "max_position_embeddings", None) or 2**31)
        self.token_bytes = token_bytes(model)
        self._jobs: queue.Queue[Job] = queue.Queue()  # in arrival order
        self._waiting: Job | None = None  # the next job, until its row fits
        self._admitted = 0
        self._admit_lock = threading.Lock()
        self._active: list[Session] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="criticalkv-worker", daemon=True)
        self.compressor = Compressor()  # posted documents and long prompts, beside the decode steps
        self.prompts = PromptCompressions(
            self.compressor, model, config.prefill_batch_tokens, config.max_batch, config.prefill_gather_s
        )
        self.prompts.on_batch = self.metrics.prompt_batch

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()
        self.compressor.start()

    def stop(self) -> None:
        self._stop.set()
        self.compressor.stop()
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

    def conversation_ids(self, messages: Sequence[Any]) -> list[int]:
        """The turns of a conversation about a stored context (:mod:`~criticalkv.serve.conversation`)."""
        with self.tokenizer_lock:
            return conversation_ids(self.tokenizer, [(m.role, m.text()) for m in messages])

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

    def release(self) -> None:
        """Give back one admitted request's slot (as the worker does when an answer ends)."""
        with self._admit_lock:
            self._admitted -= 1

    def admitted(self) -> int:
        """How many admitted requests hold a slot now (queued, compressing or decoding)."""
        return self._admitted

    def queue_depth(self) -> int:
        return self._jobs.qsize() + (self._waiting is not None) + self.compressor.pending()

    def active(self) -> int:
        return len(self._active)

    # --- submitting work (from the event loop) -----------------------------------------------
    def submit_context(
        self, ids: list[int], spec: CacheSpec, channel: Channel, context_id: str | None = None
    ) -> Progress:
        """Compress ``ids`` (a context, question-agnostic) as ``spec`` says and store it (under ``context_id``, or a
        new id); answers ``("done", info)``, or nothing once ``channel`` is cancelled (the client
        hung up): the prefill stops at its next layer and nothing is stored. Returns the
        compression's :class:`~criticalkv.serve.cancel.Progress`, counted as its layers end."""
        passes = 1 if compresses_in_prefill(spec.method) else 2  # KVzip adds its reconstruction pass
        progress = Progress(self.model.config.num_hidden_layers * passes)

        def job() -> None:
            try:
                with cancellable(channel.cancelled, progress):
                    cache = compress(self.model, ids, spec, self.repeat)[0]
                entry = self.store.add(cache, len(ids), spec, context_id)
                if channel.cancelled.is_set():  # hung up after the last layer: not kept either
                    self.store.delete(entry.id)
                else:
                    channel.put("done", entry.info())
            except Cancelled:
                logger.info("a context's client hung up: compression stopped after %d layers", progress.layers_done)
            finally:
                self.release()

        self.compressor.submit(self._guard(Job(job), channel).run)  # beside the decode steps
        return progress

    def submit_chat(self, work: ChatWork, channel: Channel, session_type: type[Session] = Session) -> None:
        """Answer ``work`` (as a ``session_type``); streams ``("delta", text)`` items, then ``("done", summary)``."""

        def job() -> Session | None:
            session = session_type(self, work, channel)
            if work.context_id is None and len(work.prompt_ids) >= self.config.offload_prompt_tokens:
                session.reserve = reserve
                self.prompts.submit(session)  # a long prompt: the worker takes it back compressed
                return session
            try:
                session.start()
            except BaseException:
                self.release()
                raise
            if session.done:
                self.release()
                return None
            return session

        context_bytes = 0
        if work.context_id is not None:
            with contextlib.suppress(APIError):  # deleted meanwhile: the job answers 404 itself
                context_bytes = int(self.store.info(work.context_id)["kv_bytes"])
        reserve = answer_reserve(self.model, work.spec.storage, work, self.token_bytes)
        self._submit(Job(job, work.context_id, context_bytes, reserve), channel)

    def _submit(self, job: Job, channel: Channel) -> None:
        self._jobs.put(self._guard(job, channel))

    def _guard(self, job: Job, channel: Channel) -> Job:
        """``job`` answering its errors on ``channel`` (an APIError as is, anything else a 500)."""

        def guarded() -> Session | None:
            try:
                session = job.run()
                if session is not None:
                    session.reserve = job.reserve
                return session
            except Exception as error:
                if not isinstance(error, APIError):
                    logger.exception("request failed in the worker")
                channel.put("error", server_error(error))
            return None

        return dataclasses.replace(job, run=guarded)

    # --- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._active.extend(self.prompts.take(self.release))  # compressed prompts, first token out
            self._start_arrivals()
            self._drop_finished()
            if self._active:
                self._decode_step()
            elif self.prompts.sessions:
                self.prompts.wait(0.05)  # nothing to decode: until a prompt's compression ends

    def _start_arrivals(self) -> None:
        """Run queued jobs in order while fewer than ``max_batch`` answers decode and the next
        one fits in the memory cap beside them (waiting briefly when idle), then start the
        answers on stored contexts together (:meth:`_start_rows`)."""
        starting: list[Session] = []
        compressing = self.prompts.sessions  # they count as rows: they hold memory and will decode
        while len(self._active) + len(starting) + len(compressing) < self.config.max_batch:
            if self._waiting is None:
                try:
                    idle = not self._active and not starting and not compressing
                    self._waiting = self._jobs.get(timeout=0.05) if idle else self._jobs.get_nowait()
                except queue.Empty:
                    break
            job, rows = self._waiting, [*self._active, *starting, *compressing]
            if rows and not self._fits(job, rows):
                break  # it starts once rows that hold memory have left
            self._waiting = None
            session = job.run()
            if session is not None and not session.compressing:
                (starting if session.starting() else self._active).append(session)
        if starting:
            self._start_rows(starting)
        self.metrics.rows(self._active, self.rows_bytes())

    def _fits(self, job: Job, rows: Sequence[Session]) -> bool:
        """Whether ``job``'s stored context (unless a row reads it already) and its reserve fit
        in the memory cap beside what ``rows`` may hold."""
        readers = [s for s in rows if s.cache is not None]  # a finished row has let go of its context
        shared = job.context_id is not None and any(s.work.context_id == job.context_id for s in readers)
        adds = job.reserve + (0 if shared else job.context_bytes)
        return self.rows_bytes(rows, reserved=True) + adds <= self.config.memory_cap_bytes

    def _start_rows(self, sessions: list[Session]) -> None:
        """Append the questions of ``sessions`` (forks of stored contexts) in one forward: each
        row's first token; they then decode with the others."""
        try:
            logits = append_rows(self.model, [s.cache for s in sessions], [s.question or [] for s in sessions])  # type: ignore[misc]
        except Exception as error:
            logger.exception("starting %d answers failed", len(sessions))
            for session in sessions:
                session.channel.put("error", APIError(500, f"starting the answer failed: {error}", type="server_error"))
                session.done = True
        else:
            self.metrics.start_step(len(sessions))
            for session, row in zip(sessions, logits, strict=True):
                session.first(row)
        self._active.extend(sessions)  # the finished ones leave at once (_drop_finished)

    def rows_bytes(self, rows: Sequence[Session] | None = None, reserved: bool = False) -> int:
        """KV bytes the answers being decoded (or ``rows``) hold (:func:`held_bytes`)."""
        return held_bytes(self._active if rows is None else rows, reserved)

    def _drop_finished(self) -> None:
        finished = [s for s in self._active if not s.pending()]
        for session in finished:
            self._active.remove(session)
            session.cache = None
            self.release()
        if finished:
            self.metrics.rows(self._active, self.rows_bytes())

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
        self.metrics.rows(self._active, self.rows_bytes())
