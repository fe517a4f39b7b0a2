"""``POST /v1/completions``: OpenAI's legacy completions, as lm-eval's ``local-completions`` uses them.

The prompt (text, token ids, or a list of either: one choice each) is compressed question-aware
with the request's (or the server's) method, budget and window, and decoded by the engine's
batched worker like a chat answer without a chat template (:class:`CompletionSession`, which also
notes each generated token's log-probability). ``echo`` puts the prompt before the answer; with
``logprobs`` it also scores every prompt token, from one uncompressed prefill of the prompt on the
compression thread: the server cannot tell which part of a prompt is the context, so prompt
scores are the full cache's (what ``loglikelihood`` through ``local-completions`` measures).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import torch
from fastapi import FastAPI
from pydantic import BaseModel

from criticalkv.runtime import capture_prefill, input_device
from criticalkv.serve.engine import Engine
from criticalkv.serve.errors import invalid
from criticalkv.serve.prepare import check_model_and_n, compression_for, sampling_of, stops_of, too_long
from criticalkv.serve.schemas import CompletionRequest
from criticalkv.serve.session import Channel, ChatWork, Session

#: the most alternatives per token a request may ask for (as OpenAI's API)
MAX_LOGPROBS = 5


class TokenScore(BaseModel):
    """One token's log-probability and its most likely alternatives."""

    token: int
    logprob: float
    top: dict[int, float]


def score_of(logits: torch.Tensor, token: int) -> TokenScore:
    """``token``'s float32 log-probability under the (V,) ``logits`` and the :data:`MAX_LOGPROBS` likeliest."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(MAX_LOGPROBS)
    return TokenScore(
        token=token, logprob=float(logprobs[token]), top=dict(zip(ids.tolist(), values.tolist(), strict=True))
    )


class CompletionChannel(Channel):
    """A request's channel that keeps the session answering it (for its token scores)."""

    session: CompletionSession | None = None

    def put(self, kind: str, value: Any) -> None:
        if kind == "done" and self.session is not None:
            self.session.note_pending()  # the last token's score, before the request reads them
        super().put(kind, value)


class CompletionSession(Session):
    """A chat session that also notes each generated token's :class:`TokenScore`."""

    def __init__(self, engine: Any, work: ChatWork, channel: Channel) -> None:
        super().__init__(engine, work, channel)
        self.scores: list[TokenScore] = []
        self.deciding: tuple[torch.Tensor, int] | None = None  # the logits being decided, tokens before
        if isinstance(channel, CompletionChannel):
            channel.session = self

    def first(self, logits: torch.Tensor) -> None:
        self.deciding = (logits, len(self.tokens))
        super().first(logits)
        self.note_pending()

    def advance(self, logits: torch.Tensor) -> None:
        self.deciding = (logits, len(self.tokens))
        super().advance(logits)
        self.note_pending()

    def note_pending(self) -> None:
        """Score the token the pending logits chose, if one was kept (an end-of-sequence token is not)."""
        if self.deciding is not None:
            logits, count = self.deciding
            self.deciding = None
            if len(self.tokens) > count:
                self.scores.append(score_of(logits, self.tokens[-1]))


def _prompts(body: CompletionRequest, engine: Engine) -> list[tuple[list[int], str | None]]:
    """The request's prompts as token ids (with the text, when sent as text), each checked
    (non-empty, ids in the vocabulary)."""
    prompt = body.prompt
    items: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not items:
        raise invalid("prompt is empty; send text or token ids", "prompt")
    vocabulary = int(engine.model.config.vocab_size)
    prompts = []
    for item in items:
        if isinstance(item, str):
            with engine.tokenizer_lock:
                ids = list(engine.tokenizer(item, add_special_tokens=False)["input_ids"])
        else:
            ids = list(item)
        if not ids:
            raise invalid("a prompt is empty; send text or token ids", "prompt")
        if any(not 0 <= t < vocabulary for t in ids):
            raise invalid(f"prompt token ids must be in [0, {vocabulary})", "prompt")
        prompts.append((ids, item if isinstance(item, str) else None))
    return prompts


def _check(body: CompletionRequest, engine: Engine) -> int:
    """The request's ``max_tokens`` after every check of its fields (a 400 or 404 naming the field)."""
    check_model_and_n(body.model, body.n, engine.config.model_name)
    if body.stream:
        raise invalid("streaming completions is not supported; send stream=false (chat completions stream)", "stream")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}], not {body.logprobs}", "logprobs")
    most = engine.config.max_new_tokens
    max_tokens = min(16, most) if body.max_tokens is None else body.max_tokens
    if not (0 if body.echo else 1) <= max_tokens <= most:
        low = "0 (with echo)" if body.echo else "1"
        raise invalid(f"max_tokens must be in [{low}, {most}], not {max_tokens}", "max_tokens")
    return max_tokens


def _work(body: CompletionRequest, engine: Engine, ids: list[int], max_tokens: int) -> ChatWork:
    """The prompt's generation, compressed as a chat prompt is (a short prompt kept whole at the
    server's defaults; a budget or window the request set itself refused when it cannot hold)."""
    need, limit = len(ids) + max_tokens, engine.max_positions
    advice = "send a shorter prompt or fewer max_tokens"
    overflow = too_long(limit, need, "the prompt and max_tokens", advice, "prompt") if need > limit else None
    method, budget, window = compression_for(engine, len(ids), body, "prompt", overflow=overflow)
    admitted = time.perf_counter()
    return ChatWork(
        ids, None, method, budget, window, max_tokens, len(ids), admitted, sampling_of(body), stops_of(body.stop)
    )


async def _generate(work: ChatWork, engine: Engine) -> tuple[dict[str, Any], list[TokenScore]]:
    """Run ``work`` on the engine's worker: its summary (text, finish reason) and token scores."""
    engine.admit()
    channel = CompletionChannel(asyncio.get_running_loop())
    engine.submit_chat(work, channel, CompletionSession)
    try:
        while True:
            kind, value = await channel.get()
            if kind == "error":
                raise value
            if kind == "done":
                session = channel.session
                return dict(value), [] if session is None else session.scores
    except asyncio.CancelledError:
        channel.cancelled.set()
        raise


def prompt_scores(model: Any, ids: list[int]) -> list[TokenScore]:
    """The scores of ``ids[1:]``, each given the tokens before it, from one uncompressed prefill."""
    tensor = torch.tensor([ids], dtype=torch.long, device=input_device(model))
    with torch.no_grad():
        _, logits = capture_prefill(model, tensor, torch.ones_like(tensor), window=1, logits_to_keep=len(ids))
    return [score_of(logits[0, i - 1], ids[i]) for i in range(1, len(ids))]


async def _echo_scores(engine: Engine, ids: list[int]) -> list[TokenScore]:
    """:func:`prompt_scores` on the compression thread (beside the decode steps, after queued prefills)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[list[TokenScore]] = loop.create_future()

    def job() -> None:
        try:
            result = prompt_scores(engine.model, ids)
        except Exception as error:  # answered on the request
            loop.call_soon_threadsafe(done.set_exception, error)
        else:
            loop.call_soon_threadsafe(done.set_result, result)

    engine.compressor.submit(job)
    return await done


def _logprobs_body(engine: Engine, scores: list[TokenScore | None], tokens: list[int], top: int) -> dict[str, Any]:
    """OpenAI's ``logprobs`` object: each token's text, log-probability, ``top`` alternatives, offset."""
    with engine.tokenizer_lock:
        texts = [str(engine.tokenizer.decode([t])) for t in tokens]
        names = {t: str(engine.tokenizer.decode([t])) for s in scores if s is not None for t in s.top}
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if s is None else s.logprob for s in scores],
        "top_logprobs": [None if s is None else {names[t]: v for t, v in list(s.top.items())[:top]} for s in scores],
        "text_offset": offsets,
    }


async def _choice(
    body: CompletionRequest, engine: Engine, prompt: tuple[list[int], str | None], max_tokens: int, index: int
) -> Any:
    """One prompt's choice and its (prompt, completion) token counts."""
    ids, prompt_text = prompt
    summary: dict[str, Any] = {"text": "", "finish_reason": "length", "completion_tokens": 0}
    generated: list[TokenScore] = []
    if max_tokens > 0:
        summary, generated = await _generate(await asyncio.to_thread(_work, body, engine, ids, max_tokens), engine)
    text = str(summary["text"])
    if body.echo and prompt_text is not None:
        text = prompt_text + text
    elif body.echo:
        with engine.tokenizer_lock:
            text = str(engine.tokenizer.decode(ids)) + text
    logprobs = None
    if body.logprobs is not None:
        scores: list[TokenScore | None] = [None, *await _echo_scores(engine, ids)] if body.echo else []
        tokens = [*ids] if body.echo else []
        scores += generated
        tokens += [s.token for s in generated]
        logprobs = _logprobs_body(engine, scores, tokens, max(body.logprobs, 1) if body.logprobs else 0)
    choice = {"index": index, "text": text, "finish_reason": summary["finish_reason"], "logprobs": logprobs}
    return choice, len(ids), int(summary["completion_tokens"])


async def complete(body: CompletionRequest, engine: Engine) -> dict[str, Any]:
    """The response to a completions request: one choice per prompt, in order."""
    max_tokens = _check(body, engine)
    prompts = await asyncio.to_thread(_prompts, body, engine)
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, prompt in enumerate(prompts):
        choice, used, made = await _choice(body, engine, prompt, max_tokens, index)
        choices.append(choice)
        prompt_tokens, completion_tokens = prompt_tokens + used, completion_tokens + made
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return {
        "id": "cmpl-" + secrets.token_hex(12),
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.config.model_name,
        "choices": choices,
        "usage": {**usage, "total_tokens": prompt_tokens + completion_tokens},
    }


def add_routes(app: FastAPI, engine: Engine) -> None:
    """Register ``POST /v1/completions`` on ``app``."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        return await complete(body, engine)
