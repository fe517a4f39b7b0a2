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

from criticalkv.cache import CacheSpec
from criticalkv.serve.cancel import Progress
from criticalkv.serve.errors import APIError
from criticalkv.serve.session import Channel


class PendingContexts:
    """Contexts being compressed, and those whose compression failed, by id (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}

    def start(
        self,
        context_id: str,
        tokens: int,
        spec: CacheSpec,
        progress: Progress,
        channel: Channel,
    ) -> dict[str, Any]:
        entry = {"id": context_id, "object": "context", "status": "compressing", "tokens": tokens}
        entry.update(method=spec.method.name, budget=spec.budget, window=spec.window)
        entry.update(created=int(time.time()), kv_bytes=None)
        with self._lock:
            self._entries[context_id] = {
                **entry, "_started": time.monotonic(), "_progress": progress, "_channel": channel
            }  # fmt: skip
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
        """Forget a failed context, or stop a compressing one (``DELETE``: it stops at its next
        layer and nothing is stored); ``False`` if the id is not pending here."""
        with self._lock:
            entry = self._entries.pop(context_id, None)
        if entry is None:
            return False
        if entry["status"] == "compressing":
            channel: Channel = entry["_channel"]
            channel.cancelled.set()
            channel.put("error", APIError(404, "deleted while compressing"))  # ends its follower
        return True

    def check_usable(self, context_id: str) -> None:
        """A 409 if ``context_id`` is still compressing or its compression failed (a question
        about it cannot be answered yet, or ever)."""
        entry = self.info(context_id)
        if entry is None:
            return
        if entry["status"] == "compressing":
            raise APIError(
                409,
                f"context {context_id} is still being compressed ({entry['layers_done']} of "
                f"{entry['layers_total']} layers); ask again once GET /v1/contexts/{context_id} shows it ready",
                param="context_id",
                code="context_not_ready",
            )
        raise APIError(
            409,
            f"context {context_id} failed to compress ({entry.get('error')}); delete it and create it again",
            param="context_id",
            code="context_failed",
        )


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
