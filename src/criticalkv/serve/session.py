"""One chat request being answered: its cache, decoding step by step, text as it grows."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from criticalkv.cache import CacheSpec
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.serve.compress import batchable, compress
from criticalkv.serve.sampling import Sampling, TokenChooser
from criticalkv.serve.stops import StopText


class Channel:
    """Items from the worker thread to one request's coroutine, and the request's cancellation."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()

    def put(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed (server shutting down): nobody is listening
            self.cancelled.set()

    async def get(self) -> tuple[str, Any]:
        return await self.queue.get()


@dataclass
class ChatWork:
    """A validated chat request: a stored context and question ids, or a whole prompt's ids, and
    ``spec``: the stored context's cache, or the one the prompt is compressed with (its window
    within the prompt: :func:`~criticalkv.serve.prepare.compression_for`)."""

    prompt_ids: list[int]
    context_id: str | None
    spec: CacheSpec
    max_tokens: int
    prompt_tokens: int
    admitted_at: float
    sampling: Sampling = field(default_factory=Sampling)
    stops: tuple[str, ...] = ()  # the answer ends before the first of them
    ignore_eos: bool = False  # an end-of-sequence token does not end the answer (vLLM's benchmark option)


class IncrementalText:
    """Text deltas of a growing token list whose concatenation is the final answer (stripped,
    special tokens skipped, ended before the first of ``stops``): trailing whitespace, incomplete
    characters and what may start a stop sequence are held back (:class:`StopText`)."""

    def __init__(self, tokenizer: Any, lock: threading.Lock, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.lock = tokenizer, lock
        self.text = StopText(stops)

    @property
    def emitted(self) -> str:
        return self.text.emitted

    @property
    def stopped(self) -> bool:
        """Whether a stop sequence has ended the answer."""
        return self.text.stopped

    def delta(self, tokens: list[int], final: bool = False) -> str:
        with self.lock:
            text = str(self.tokenizer.decode(tokens, skip_special_tokens=True)).lstrip()
        return self.text.update(text if final else text.rstrip("\ufffd"), final)


class Session:
    """Decoding of one :class:`ChatWork`, greedy or sampled (:mod:`~criticalkv.serve.sampling`):
    :meth:`start` (and, on a stored context, the engine's batched start of every answer that
    starts in the same step, :meth:`first`), then one token per batched decode step the engine
    runs over every pending session (:meth:`advance`)."""

    def __init__(self, engine: Any, work: ChatWork, channel: Channel) -> None:
        self.engine, self.work, self.channel = engine, work, channel
        self.tokens: list[int] = []
        self.text = IncrementalText(engine.tokenizer, engine.tokenizer_lock, work.stops)
        self.chooser = TokenChooser(work.sampling)  # its own generator when sampling
        self.done = False
        self.cache: CompressedCache | None = None
        self.next_token: int | None = None
        self.context_bytes = 0  # KV bytes of the stored context the cache forks (shared with others)
        self.question: list[int] | None = None  # to append to the fork, until the answer starts
        self.reserve = 0  # the most KV bytes of its own the answer may hold (set by the engine)
        self.compressing = False  # its prompt is on the compression thread (serve.prompt_queue)
        self.first_token_s: float | None = None  # seconds from admission to the first token

    def start(self) -> None:
        """Build the request's cache: a fork of its stored context (its question is appended with
        those of the other answers that start in the same step, :meth:`first` takes the logits),
        or a compressed prompt and its first token."""
        work = self.work
        if work.context_id is not None:
            _, stored = self.engine.store.get(work.context_id)
            self.cache = stored.fork()
            self.context_bytes = stored.kv_bytes()
            self.question = work.prompt_ids
            return
        self.cache, logits = self.compress_prompt()
        self.first(logits)

    def compress_prompt(self) -> tuple[CompressedCache, torch.Tensor]:
        """The request's prompt compressed (question-aware) and the (V,) logits that follow it;
        touches nothing of the session, so it may run on the compression thread."""
        return compress(self.engine.model, self.work.prompt_ids, self.work.spec, self.engine.repeat)

    def batch_key(self) -> tuple[str, float, int] | None:
        """What the prompts compressed in one batch with this one share (its spec's method, budget
        and window; the storage is unquantized), or ``None`` if this prompt is compressed alone
        (:func:`~criticalkv.serve.compress.batchable`)."""
        spec = self.work.spec
        if not batchable(spec):
            return None
        return spec.method.name, float(spec.budget), spec.window

    def holds_memory(self) -> bool:
        """Whether the answer holds (or, being compressed, is building) KV bytes of its own."""
        return self.cache is not None or self.compressing

    def starting(self) -> bool:
        """Whether the question still has to be appended to the fork (a batched start)."""
        return self.question is not None

    def first(self, logits: torch.Tensor) -> None:
        """Take the (V,) logits that follow the prompt: the first token."""
        self.question = None
        self.first_token_s = time.perf_counter() - self.work.admitted_at  # for the access log
        self.engine.metrics.first_token(self.first_token_s)
        self._emit(self.chooser.choose(logits))

    def own_bytes(self) -> int:
        """KV bytes this answer's cache holds of its own (beyond the stored context it shares)."""
        return 0 if self.cache is None else self.cache.kv_bytes() - self.context_bytes

    def pending(self) -> bool:
        """Whether the session waits for a decode step (a token to feed, its client still there)."""
        return not self.done and not self.cancelled() and self.next_token is not None

    def advance(self, logits: torch.Tensor) -> None:
        """Take the (V,) logits of the decode step that fed :attr:`next_token`."""
        self._emit(self.chooser.choose(logits))

    def cancelled(self) -> bool:
        return self.channel.cancelled.is_set()

    def _emit(self, token: int) -> None:
        if token in self.engine.eos and not self.work.ignore_eos:
            self._finish("stop")
            return
        self.tokens.append(token)
        self.engine.metrics.token()
        piece = self.text.delta(self.tokens) if self.work.stops or len(self.tokens) < self.work.max_tokens else ""
        if piece:
            self.channel.put("delta", piece)
        if self.text.stopped:
            self._finish("stop")  # a stop sequence: the row leaves the batch as at EOS
        elif len(self.tokens) >= self.work.max_tokens:
            self._finish("length")
        else:
            self.next_token = token

    def _finish(self, reason: str) -> None:
        piece = self.text.delta(self.tokens, final=True)
        if piece:
            self.channel.put("delta", piece)
        self.done = True
        self.next_token = None
        kept = 0 if self.cache is None else self.cache.kv_bytes()  # for the access log
        self.cache = None  # frees the fork's tail now
        self.channel.put(
            "done",
            {
                "text": self.text.emitted,
                "finish_reason": reason,
                "prompt_tokens": self.work.prompt_tokens,
                "completion_tokens": len(self.tokens),
                "kv_bytes": kept,
                "ttft_s": self.first_token_s,
            },
        )
