"""Contexts compressing in the background: their state until stored (or failed).

``POST /v1/contexts`` with ``"wait": false`` answers ``202`` at once with the new context's id and
``"status": "compressing"``; the compression runs on the engine as a blocking creation's does, and
``GET /v1/contexts/{id}`` then shows ``compressing`` (with the seconds elapsed and the decoder
layers done, ``layers_done`` of ``layers_total``: :class:`~criticalkv.serve.cancel.Progress`), ``failed`` (with
the error's message, kept until the id is deleted) or the stored context, ``ready``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from criticalkv.serve.cancel import Progress
from criticalkv.serve.errors import APIError
from criticalkv.serve.session import Channel


class PendingContexts:
    """Contexts being compressed, and those whose compression failed, by id (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}

    def start(
        self, context_id: str, tokens: int, method: str, budget: float, window: int, progress: Progress
    ) -> dict[str, Any]:
        entry = {"id": context_id, "object": "context", "status": "compressing", "tokens": tokens}
        entry.update(method=method, budget=budget, window=window, created=int(time.time()), kv_bytes=None)
        with self._lock:
            self._entries[context_id] = {**entry, "_started": time.monotonic(), "_progress": progress}
            return _public(self._entries[context_id])

    def finish(self, context_id: str) -> None:
        """Stored: the store describes it from now on."""
        with self._lock:
            self._entries.pop(context_id, None)

    def fail(self, context_id: str, error: Exception) -> None:
        message = error.message if isinstance(error, APIError) else f"{type(error).__name__}: {error}"
        with self._lock:
            if context_id in self._entries:
                self._entries[context_id].update(status="failed", error=message)

    def info(self, context_id: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self._entries.get(context_id)
            return None if entry is None else _public(entry)

    def infos(self) -> list[dict[str, Any]]:
        with self._lock:
            return [_public(e) for e in self._entries.values()]

    def discard(self, context_id: str) -> bool:
        """Forget a failed context (``DELETE``); ``False`` if it is not a failed one here."""
        with self._lock:
            if self._entries.get(context_id, {}).get("status") != "failed":
                return False
            del self._entries[context_id]
            return True


def _public(entry: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in entry.items() if not k.startswith("_")}
    if out["status"] == "compressing":
        out["elapsed_s"] = round(time.monotonic() - entry["_started"], 3)
        progress = entry["_progress"]
        out.update(layers_done=progress.layers_done, layers_total=progress.layers_total)
    return out


async def follow(channel: Channel, pending: PendingContexts, context_id: str) -> None:
    """Wait for a background compression's end and note it: stored, or failed with its message."""
    kind, value = await channel.get()
    if kind == "error":
        pending.fail(context_id, value)
    else:
        pending.finish(context_id)
