"""A request's client hanging up: noticed while the request waits on the engine, so its work stops."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from criticalkv.serve.session import Channel


async def until_disconnected(request: Request) -> None:
    """Return once the client of ``request`` (whose body has been read) has hung up: the server
    answers the next ``receive`` with ``http.disconnect`` then (or once the response is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def outcome_or_hang_up(channel: Channel, request: Request) -> tuple[str, Any] | None:
    """The next item on ``channel``; ``None`` (and the channel cancelled: the work stops at its
    next step, nothing is kept) if the client hangs up first."""
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
        return None
    return outcome.result()
