"""The FastAPI application: the OpenAI-compatible routes, the contexts resource, ``/metrics``.

Every error answers with OpenAI's error body (``{"error": {"message", "type", "param",
"code"}}``); with an API key, every route requires ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from criticalkv.serve.chat import answer
from criticalkv.serve.completions import add_completion_routes
from criticalkv.serve.compress import check_compressible
from criticalkv.serve.contexts import PendingContexts, add_context_routes, follow
from criticalkv.serve.engine import Engine
from criticalkv.serve.errors import APIError, invalid
from criticalkv.serve.middleware import Authentication, BodyLimit
from criticalkv.serve.schemas import ChatRequest, ContextCreate
from criticalkv.serve.session import Channel
from criticalkv.serve.store import new_id


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    problems = error.errors()
    if any(p.get("type") == "json_invalid" for p in problems):
        return "the request body is not valid JSON", None
    first = problems[0] if problems else {}
    # pydantic names a union's branch or a validator in the location ("function-after[...]"): not a field
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body" and "[" not in str(part)) or None
    return f"{where or 'body'}: {first.get('msg', 'invalid value')}", where


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every error with OpenAI's error body."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return JSONResponse(invalid(message, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(error.status_code, str(error.detail), type=kind).body(), error.status_code)


async def until_disconnected(request: Request) -> None:
    """Return once the client of ``request`` (whose body has been read) has hung up: the server
    answers the next ``receive`` with ``http.disconnect`` then (or once the response is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _outcome_or_hang_up(channel: Channel, request: Request) -> Response:
    """The stored context's description once its compression ends; if the client hangs up first,
    the compression is cancelled (it stops at its next layer, nothing is stored) and the answer,
    which nobody reads, is a 499."""
    outcome = asyncio.ensure_future(channel.get())
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({outcome, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping
        channel.cancelled.set()
        raise
    finally:
        outcome.cancel()
        gone.cancel()
    if not outcome.done() or outcome.cancelled():
        channel.cancelled.set()
        return Response(status_code=499)
    kind, value = outcome.result()
    if kind == "error":
        raise value
    return JSONResponse(dict(value))


async def _create_context(body: ContextCreate, request: Request, engine: Engine, pending: PendingContexts) -> Response:
    """Check a document, compress it on the engine and answer its context's description (with
    ``wait`` false: answer 202 with its id at once, the compression going on in the background;
    blocking, a client that hangs up cancels it)."""
    method, budget, window = engine.config.compression(body.method, body.budget, body.window)
    if not body.text.strip():
        raise invalid("text is empty; send the document to compress", "text")
    ids = await asyncio.to_thread(engine.context_ids, body.text)  # a long document: off the event loop
    if len(ids) < window:
        raise invalid(
            f"the document has {len(ids)} tokens, fewer than the observation window ({window}); "
            "send a longer document or a smaller window",
            "text",
        )
    if len(ids) >= engine.max_positions:
        raise invalid(
            f"the document has {len(ids)} tokens; this model accepts {engine.max_positions} in all",
            "text",
            "context_length_exceeded",
        )
    at_fault = "window" if body.window is not None else "budget" if body.budget is not None else "text"
    check_compressible(len(ids), budget, window, engine.quantization, "document", at_fault)
    engine.admit()
    channel = Channel(asyncio.get_running_loop())
    if not body.wait:
        context_id = new_id()
        progress = engine.submit_context(ids, method, budget, window, channel, context_id)
        entry = pending.start(context_id, len(ids), method, budget, window, progress)
        _BACKGROUND.add(task := asyncio.create_task(follow(channel, pending, context_id)))
        task.add_done_callback(_BACKGROUND.discard)
        return JSONResponse(entry, status_code=202)
    engine.submit_context(ids, method, budget, window, channel)
    return await _outcome_or_hang_up(channel, request)


#: the tasks following background compressions (held so that they are not garbage-collected)
_BACKGROUND: set[asyncio.Task[None]] = set()


def _add_routes(app: FastAPI, engine: Engine, pending: PendingContexts) -> None:
    """The OpenAI-compatible routes, the contexts resource and ``/metrics``."""
    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": engine.config.model_name, "object": "model", "created": created, "owned_by": "criticalkv"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest) -> Response:
        return await answer(body, engine)

    @app.post("/v1/contexts", response_model=None)
    async def create_context(body: ContextCreate, request: Request) -> Response:
        return await _create_context(body, request, engine, pending)

    @app.get("/v1/contexts/{context_id}")
    async def get_context(context_id: str) -> dict[str, Any]:
        return pending.info(context_id) or engine.store.info(context_id)

    @app.delete("/v1/contexts/{context_id}")
    async def delete_context(context_id: str) -> dict[str, Any]:
        if not pending.discard(context_id):
            engine.store.delete(context_id)
        return {"id": context_id, "object": "context.deleted", "deleted": True}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = engine.metrics.render(engine.store.stats(), engine.queue_depth(), engine.active())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def build_app(engine: Engine) -> FastAPI:
    """The server's application around ``engine`` (started and stopped with the app)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="criticalkv", lifespan=lifespan)
    _add_error_handlers(app)
    app.add_middleware(BodyLimit, engine=engine)  # inside authentication (the last added runs first)
    app.add_middleware(Authentication, engine=engine)
    pending = PendingContexts()
    _add_routes(app, engine, pending)
    add_context_routes(app, engine, pending)
    add_completion_routes(app, engine)
    return app
