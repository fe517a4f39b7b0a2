"""``GET /v1/models``: the one model served."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI

from criticalkv.serve.engine import Engine


def add_routes(app: FastAPI, engine: Engine) -> None:
    """Register ``GET /v1/models`` on ``app``."""
    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": engine.config.model_name, "object": "model", "created": created, "owned_by": "criticalkv"}
        return {"object": "list", "data": [entry]}
