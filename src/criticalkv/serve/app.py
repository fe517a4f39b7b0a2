"""The FastAPI application: the middlewares, the error handlers and the routes (:mod:`~criticalkv.serve.routes`).

Every error answers with OpenAI's error body (``{"error": {"message", "type", "param",
"code"}}``); with an API key, every route requires ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from criticalkv.serve.engine import Engine
from criticalkv.serve.errors import APIError, invalid
from criticalkv.serve.hangup import ClientGone
from criticalkv.serve.middleware import AccessLog, Authentication, BodyLimit
from criticalkv.serve.routes import add_routes

#: the seconds a 429 tells its client to wait before retrying
RETRY_AFTER_S = 1


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
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else None  # clients back off by it
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return JSONResponse(invalid(message, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(error.status_code, str(error.detail), type=kind).body(), error.status_code)


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
    app.add_middleware(AccessLog)  # outermost: every request, refused ones included
    add_routes(app, engine)
    return app
