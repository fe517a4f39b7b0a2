"""``/v1/contexts``: create (compress and store a document), list, show and delete contexts.

``POST /v1/contexts`` answers the stored context's description once compressed (a client that
hangs up meanwhile cancels it), or, with ``"wait": false``, ``202`` at once with the new id while
the compression goes on in the background (:mod:`~criticalkv.serve.background`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from criticalkv.serve.background import PendingContexts, follow
from criticalkv.serve.engine import Engine
from criticalkv.serve.errors import APIError, invalid
from criticalkv.serve.hangup import outcome_or_hang_up
from criticalkv.serve.prepare import admit, compression_for
from criticalkv.serve.schemas import ContextCreate
from criticalkv.serve.session import Channel
from criticalkv.serve.store import new_id

#: the tasks following background compressions (held so that they are not garbage-collected)
_BACKGROUND: set[asyncio.Task[None]] = set()


async def _create(body: ContextCreate, request: Request, engine: Engine, pending: PendingContexts) -> Response:
    """Check a document, compress it on the engine and answer its context's description (with
    ``wait`` false: answer 202 with its id at once, the compression going on in the background;
    blocking, a client that hangs up cancels it)."""
    engine.config.spec_for(body.method, body.budget, body.window)  # the options first
    if not body.text.strip():
        raise invalid("text is empty; send the document to compress", "text")
    ids = await asyncio.to_thread(engine.context_ids, body.text)  # a long document: off the event loop
    overflow = None
    if len(ids) >= engine.max_positions:
        overflow = invalid(
            f"the document has {len(ids)} tokens; this model accepts {engine.max_positions} in all",
            "text",
            "context_length_exceeded",
        )
    spec = compression_for(engine, len(ids), body, "text", "document", overflow)
    await admit(engine)
    channel = Channel(asyncio.get_running_loop())
    if not body.wait:
        context_id = new_id()
        progress = engine.submit_context(ids, spec, channel, context_id)
        entry = pending.start(context_id, len(ids), spec, progress, channel)
        _BACKGROUND.add(task := asyncio.create_task(follow(channel, pending, context_id)))
        task.add_done_callback(_BACKGROUND.discard)
        return JSONResponse(entry, status_code=202)
    engine.submit_context(ids, spec, channel)
    kind, value = await outcome_or_hang_up(channel, request)
    if kind == "error":
        raise value
    access = {"method": spec.method.name, "budget": spec.budget, "tokens": len(ids), "kv_bytes": value["kv_bytes"]}
    request.state.access = access
    return JSONResponse(dict(value))


def add_routes(app: FastAPI, engine: Engine) -> None:
    """Register ``POST``/``GET /v1/contexts`` and ``GET``/``DELETE /v1/contexts/{id}`` on ``app``
    (the contexts compressing in the background: ``app.state.pending``, which chat reads too)."""
    pending: PendingContexts = app.state.pending

    @app.post("/v1/contexts", response_model=None)
    async def create_context(body: ContextCreate, request: Request) -> Response:
        return await _create(body, request, engine, pending)

    @app.get("/v1/contexts")
    async def list_contexts() -> dict[str, Any]:
        stored = await asyncio.to_thread(engine.store.infos)
        kept, full = sum(c["kv_bytes"] for c in stored), sum(c["kv_bytes_full"] for c in stored)
        totals = {"kv_bytes": kept, "kv_bytes_full": full, "kv_ratio": round(kept / full, 4) if full else None}
        answerable = sum(1 for c in stored if c["answerable"])
        return {"object": "list", "data": [*pending.infos(), *stored], "totals": totals, "answerable": answerable}

    @app.get("/v1/contexts/{context_id}")
    async def get_context(context_id: str) -> dict[str, Any]:
        return pending.info(context_id) or engine.store.info(context_id)

    @app.delete("/v1/contexts/{context_id}")
    async def delete_context(context_id: str) -> dict[str, Any]:
        if not pending.discard(context_id):
            engine.store.delete(context_id)
        else:  # stored just before the DELETE stopped it: not kept either
            with contextlib.suppress(APIError):
                engine.store.delete(context_id)
        return {"id": context_id, "object": "context.deleted", "deleted": True}
