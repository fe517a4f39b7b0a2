"""``GET /health``: the server is up, its model and its queue depth."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from criticalkv.serve.engine import Engine


def add_routes(app: FastAPI, engine: Engine) -> None:
    """Register ``GET /health`` on ``app``."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.config.model_name, "queue_depth": engine.queue_depth()}
