"""Stopping a prompt's prefill between two decoder layers once its client has gone away.

A long prompt is one forward over every layer. :func:`watch_layers` puts a check before each
decoder layer of the served model; inside :func:`cancellable` (on the thread running the
prefill) the check raises :class:`Cancelled` as soon as the request's cancellation event is
set, so the rest of the prefill is skipped and its cache can be dropped. The event is read
from a context variable, per thread: forwards on other threads (the decode steps) never see it.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_EVENT: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("criticalkv_serve_cancel", default=None)
_WATCHED: weakref.WeakSet[Any] = weakref.WeakSet()  # models whose layers already carry the check


class Cancelled(Exception):
    """The request's client went away while its prompt was being prefilled."""


def check_cancelled(_module: Any, _args: Any) -> None:
    """The forward pre-hook :func:`watch_layers` puts on each decoder layer: raises :class:`Cancelled`
    inside :func:`cancellable` once the event is set; elsewhere (a decode step) one context-variable read."""
    event = _EVENT.get()
    if event is not None and event.is_set():
        raise Cancelled("the client went away during the prompt's prefill")


def watch_layers(model: Any) -> None:
    """Put the cancellation check before every decoder layer of ``model`` (once per model)."""
    if model in _WATCHED:
        return
    for layer in model.get_decoder().layers:
        layer.register_forward_pre_hook(check_cancelled)
    _WATCHED.add(model)


@contextmanager
def cancellable(event: threading.Event) -> Iterator[None]:
    """Forwards of this thread inside the block stop at the next layer once ``event`` is set."""
    token = _EVENT.set(event)
    try:
        yield
    finally:
        _EVENT.reset(token)
