"""``GET /metrics``: the server's counters in Prometheus' text format."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from criticalkv.serve.engine import Engine


def add_routes(app: FastAPI, engine: Engine) -> None:
    """Register ``GET /metrics`` on ``app``."""

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = engine.metrics.render(engine.store.stats(), engine.queue_depth(), engine.active())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
