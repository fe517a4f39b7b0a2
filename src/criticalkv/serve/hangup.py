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


class ClientGone(Exception):
    """The request's client hung up before its answer: nobody reads it (answered 499)."""


async def outcome_or_hang_up(channel: Channel, request: Request) -> tuple[str, Any]:
    """The work's last item on ``channel`` (``("done", value)`` or ``("error", error)``, the items
    before it dropped); :class:`ClientGone` (and the channel cancelled: the work stops at its next
    step, nothing is kept) if the client hangs up first."""
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        while True:
            outcome = asyncio.ensure_future(channel.get())
            await asyncio.wait({outcome, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not outcome.done():
                outcome.cancel()
                channel.cancelled.set()
                raise ClientGone
            kind, value = outcome.result()
            if kind in ("done", "error"):
                return kind, value
    except asyncio.CancelledError:  # the server is stopping
        channel.cancelled.set()
        raise
    finally:
        gone.cancel()
