"""``POST /v1/chat/completions``: validating a request, then answering it whole or over SSE."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from criticalkv.serve.engine import Engine
from criticalkv.serve.errors import APIError, invalid, not_found
from criticalkv.serve.hangup import outcome_or_hang_up
from criticalkv.serve.middleware import note_access
from criticalkv.serve.prepare import admit, check_model_and_n, compression_for, sampling_of, stops_of, too_long
from criticalkv.serve.sampling import Sampling
from criticalkv.serve.schemas import ChatRequest
from criticalkv.serve.session import Channel, ChatWork


def _too_long(total: int, limit: int) -> APIError:
    advice = "use a shorter document or question, or fewer max_tokens"
    return too_long(limit, total, "the context, question and max_tokens", advice, "messages")


def validate(body: ChatRequest, engine: Engine) -> ChatWork:
    """The request as :class:`ChatWork`, or an :class:`APIError` saying what to fix."""
    config = engine.config
    check_model_and_n(body.model, body.n, config.model_name)
    sampling, stops = sampling_of(body), stops_of(body.stop)
    max_tokens = _max_tokens(body, config.max_new_tokens)
    question = body.messages[-1].text().strip() if body.messages[-1].role == "user" else ""
    if not question:
        raise invalid("the last message must be a user message with a non-empty question", "messages")
    admitted = time.perf_counter()
    if body.context_id is not None:
        return _stored_context_work(body, body.context_id, engine, question, max_tokens, admitted, sampling, stops)
    return _prompt_work(body, engine, max_tokens, admitted, sampling, stops)


def _max_tokens(body: ChatRequest, most: int) -> int:
    """The request's ``max_completion_tokens`` (or ``max_tokens``; left out: ``most``), in [1, ``most``]."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = most if max_tokens is None else max_tokens
    if not 1 <= max_tokens <= most:
        raise invalid(f"max_tokens must be in [1, {most}], not {max_tokens}", "max_tokens")
    return max_tokens


def _stored_context_work(
    body: ChatRequest,
    context_id: str,
    engine: Engine,
    question: str,
    max_tokens: int,
    admitted: float,
    sampling: Sampling,
    stops: tuple[str, ...],
) -> ChatWork:
    """A question about a stored context: the context's compression, the question's ids."""
    if not engine.store.has(context_id):
        raise not_found(f"no context {context_id!r}; create one with POST /v1/contexts", "context_id")
    info = engine.store.info(context_id)
    if not info["answerable"]:  # made for another model or tokenizer (a store reopened with other settings)
        raise APIError(409, info["reason"], param="context_id", code="context_incompatible")
    asked = {"method": body.method, "budget": body.budget, "window": body.window}
    for key, value in asked.items():
        if value is not None and value != info[key]:
            raise invalid(
                f"context {context_id} was compressed with {key}={info[key]!r}; omit {key} or create another context",
                key,
            )
    ids = engine.question_ids(question) if len(body.messages) == 1 else engine.conversation_ids(body.messages)
    total = info["tokens"] + len(ids) + max_tokens
    if total > engine.max_positions:
        raise _too_long(total, engine.max_positions)
    return ChatWork(
        ids,
        context_id,
        engine.store.spec(context_id),
        max_tokens,
        info["tokens"] + len(ids),
        admitted,
        sampling,
        stops,
    )


def _prompt_work(
    body: ChatRequest, engine: Engine, max_tokens: int, admitted: float, sampling: Sampling, stops: tuple[str, ...]
) -> ChatWork:
    """A whole conversation as one prompt, to compress with the request's (or the server's) settings."""
    engine.config.spec_for(body.method, body.budget, body.window)  # the options before the tokens
    ids = engine.prompt_ids([{"role": m.role, "content": m.text()} for m in body.messages])
    need = len(ids) + max_tokens
    overflow = _too_long(need, engine.max_positions) if need > engine.max_positions else None
    spec = compression_for(engine, len(ids), body, "messages", overflow=overflow)
    return ChatWork(ids, None, spec, max_tokens, len(ids), admitted, sampling, stops)


def _chunk(base: dict[str, Any], delta: dict[str, Any], finish: str | None = None) -> str:
    payload = {
        **base,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    return f"data: {json.dumps(payload)}\n\n"


async def answer(body: ChatRequest, engine: Engine, request: Request) -> JSONResponse | StreamingResponse:
    """Validate, admit (429 when full), submit; the whole answer or an SSE stream of it."""
    if body.context_id is not None:  # compressing or failed in the background: a 409 saying which
        request.app.state.pending.check_usable(body.context_id)
    work = await asyncio.to_thread(validate, body, engine)  # tokenising a long prompt: off the event loop
    await admit(engine)
    channel = Channel(asyncio.get_running_loop())
    engine.submit_chat(work, channel)
    base = {"id": "chatcmpl-" + secrets.token_hex(12), "created": int(time.time()), "model": engine.config.model_name}
    if body.stream:
        return StreamingResponse(_stream(base, channel, request, work), media_type="text/event-stream")
    kind, value = await outcome_or_hang_up(channel, request)  # a client that hangs up stops the answer
    if kind == "error":
        raise value
    note_access(request.state, work, value)
    usage = {
        "prompt_tokens": value["prompt_tokens"],
        "completion_tokens": value["completion_tokens"],
        "total_tokens": value["prompt_tokens"] + value["completion_tokens"],
    }
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": value["text"]},
        "finish_reason": value["finish_reason"],
        "logprobs": None,
    }
    return JSONResponse({**base, "object": "chat.completion", "choices": [choice], "usage": usage})


async def _stream(base: dict[str, Any], channel: Channel, request: Request, work: ChatWork) -> AsyncIterator[str]:
    finished = False
    try:
        yield _chunk(base, {"role": "assistant", "content": ""})
        while True:
            kind, value = await channel.get()
            if kind == "delta":
                yield _chunk(base, {"content": value})
            elif kind == "error":
                yield f"data: {json.dumps(value.body())}\n\n"
                break
            else:
                note_access(request.state, work, value)
                yield _chunk(base, {}, value["finish_reason"])
                break
        finished = True
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away: the worker drops the session at its next step
            channel.cancelled.set()


def add_routes(app: FastAPI, engine: Engine) -> None:
    """Register ``POST /v1/chat/completions`` on ``app``."""

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Response:
        return await answer(body, engine, request)
