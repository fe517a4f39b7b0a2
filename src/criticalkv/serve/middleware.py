"""The server's middlewares, pure ASGI: the access log, the API key and the body limit.

They hand the route the server's own ``receive`` (after a chunked body they have read, the body
first, then the server's messages), so the client's ``http.disconnect`` reaches a route waiting on
the model (:func:`criticalkv.serve.hangup.until_disconnected`), which then stops its work. Unlike
Starlette's ``BaseHTTPMiddleware`` they start no task per request and write no private attribute
of Starlette's ``Request`` (the chunked body was put in ``request._body``). (The
``BaseHTTPMiddleware`` of Starlette 1.10 forwards the disconnect too: the cancellation comes from the
route's watch; this module only keeps the path from the server to the route plain.)
"""

from __future__ import annotations

import hmac
import logging
import time

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from criticalkv.serve.engine import Engine
from criticalkv.serve.errors import APIError
from criticalkv.serve.session import ChatWork

#: one line per request: what uvicorn's and vLLM's users expect to read
access_logger = logging.getLogger("criticalkv.serve.access")


def _too_large(size: str, limit: int) -> JSONResponse:
    error = APIError(
        413,
        f"the request body has {size} bytes, more than this server accepts ({limit} bytes, --max-body-mib); "
        "send a shorter document or ask the operator to raise the limit",
        code="request_too_large",
    )
    return JSONResponse(error.body(), status_code=413)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body of a request sent without ``Content-Length`` (chunked); ``None`` as soon as
    what arrived passes ``limit``. A client that hangs up meanwhile leaves what arrived."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return bytes(body)
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with ``body`` (already read) answered first, as one message."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()  # the client's disconnect, when it comes
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


class BodyLimit:
    """Refuse a body over ``max_body_bytes`` with a 413: by its ``Content-Length`` before reading it,
    or, sent without one (chunked), as soon as what arrived passes the limit."""

    def __init__(self, app: ASGIApp, engine: Engine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.engine.config.max_body_bytes
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _too_large(declared, limit)(scope, receive, send)
            return
        if not declared and scope["method"] in ("POST", "PUT", "PATCH"):
            body = await _read_body(receive, limit)
            if body is None:
                await _too_large(f"more than {limit}", limit)(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


class Authentication:
    """With an API key configured, require ``Authorization: Bearer <key>`` on every route."""

    def __init__(self, app: ASGIApp, engine: Engine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.engine.config.api_key
        if scope["type"] == "http" and key:
            given = Headers(scope=scope).get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                error = APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AccessLog:
    """One log line per request (``criticalkv.serve.access``, INFO): the HTTP method, path, status
    and time, then what the route noted in ``request.state.access``: the compression method,
    the prompt and completion tokens, the KV bytes kept and the time to the first token."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 0

        async def noting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        scope.setdefault("state", {})
        try:
            await self.app(scope, receive, noting)
        finally:
            details = scope["state"].get("access") or {}
            fields = " ".join(f"{key}={_short(value)}" for key, value in details.items())
            elapsed = (time.perf_counter() - started) * 1000
            line = f'"{scope["method"]} {scope["path"]}" {status or 499} {elapsed:.1f}ms'
            access_logger.info("%s%s", line, f" {fields}" if fields else "")


def _short(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def note_access(state: object, work: ChatWork | None, summary: dict[str, object]) -> None:
    """What the access line says of an answer (``state``: the request's ``request.state``)."""
    ttft = summary.get("ttft_s")
    state.access = {  # type: ignore[attr-defined]
        "method": None if work is None else work.spec.method.name,
        "budget": None if work is None else work.spec.budget,
        "prompt_tokens": summary.get("prompt_tokens"),
        "completion_tokens": summary.get("completion_tokens"),
        "kv_bytes": summary.get("kv_bytes"),
        "ttft_ms": None if ttft is None else round(float(ttft) * 1000, 1),  # type: ignore[arg-type]
    }
