"""The server's routes, one module per endpoint, each with ``add_routes(app, engine)``:

* :mod:`~criticalkv.serve.routes.chat`: ``POST /v1/chat/completions``;
* :mod:`~criticalkv.serve.routes.completions`: ``POST /v1/completions``;
* :mod:`~criticalkv.serve.routes.contexts`: ``/v1/contexts`` (create, list, show, delete);
* :mod:`~criticalkv.serve.routes.models`: ``GET /v1/models``;
* :mod:`~criticalkv.serve.routes.health`: ``GET /health``;
* :mod:`~criticalkv.serve.routes.metrics`: ``GET /metrics``.

Request bodies live in :mod:`~criticalkv.serve.schemas`, the checks they share in
:mod:`~criticalkv.serve.prepare`.
"""

from __future__ import annotations

from fastapi import FastAPI

from criticalkv.serve.background import PendingContexts
from criticalkv.serve.engine import Engine
from criticalkv.serve.routes import chat, completions, contexts, health, metrics, models

__all__ = ["ROUTES", "add_routes"]

#: the route modules, each with ``add_routes(app, engine)``, in the order they are registered
ROUTES = (
    models,
    chat,
    completions,
    contexts,
    health,
    metrics,
)


def add_routes(app: FastAPI, engine: Engine) -> None:
    """Register every route of :data:`ROUTES` on ``app`` (with the contexts compressing in the
    background, ``app.state.pending``, which the contexts and chat routes share)."""
    app.state.pending = PendingContexts()
    for module in ROUTES:
        module.add_routes(app, engine)
