"""Stopping a prefill between two decoder layers once its client has gone away, and counting
the layers it has passed.

A long prompt or document is one forward over every layer. :func:`watch_layers` puts a check before
each decoder layer of the served model and a count after it; inside :func:`cancellable` (on the
thread running the prefill) the check raises :class:`Cancelled` as soon as the request's
cancellation event is set, so the rest of the prefill is skipped and its cache can be dropped, and
each layer that ends adds one to the block's :class:`Progress`. Both are read from a context
variable, per thread: forwards on other threads (the decode steps) never see them.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class Progress:
    """Decoder-layer forwards a compression has finished, of the ``layers_total`` it runs (the
    layers, times the passes: two for a method that scores a reconstruction pass, KVzip).

    Written by the compressing thread, read by any (an int's assignment is atomic)."""

    layers_total: int
    layers_done: int = 0


@dataclass(frozen=True)
class _Watch:
    event: threading.Event
    progress: Progress | None


_WATCH: contextvars.ContextVar[_Watch | None] = contextvars.ContextVar("criticalkv_serve_cancel", default=None)
_WATCHED: weakref.WeakSet[Any] = weakref.WeakSet()  # models whose layers already carry the check


class Cancelled(Exception):
    """The request's client went away while its prompt was being prefilled."""


def check_cancelled(_module: Any, _args: Any) -> None:
    """The forward pre-hook :func:`watch_layers` puts on each decoder layer: raises :class:`Cancelled`
    inside :func:`cancellable` once the event is set; elsewhere (a decode step) one context-variable read."""
    watch = _WATCH.get()
    if watch is not None and watch.event.is_set():
        raise Cancelled("the client went away during the prompt's prefill")


def count_layer(_module: Any, _args: Any, _output: Any) -> None:
    """The forward hook after each decoder layer: one more layer done for the block's :class:`Progress`."""
    watch = _WATCH.get()
    if watch is not None and watch.progress is not None:
        watch.progress.layers_done += 1


def requested() -> bool:
    """Whether this thread is inside :func:`cancellable` with its event set (its next layer stops)."""
    watch = _WATCH.get()
    return watch is not None and watch.event.is_set()


def watch_layers(model: Any) -> None:
    """Put the cancellation check and the count around every decoder layer of ``model`` (once per model)."""
    if model in _WATCHED:
        return
    for layer in model.get_decoder().layers:
        layer.register_forward_pre_hook(check_cancelled)
        layer.register_forward_hook(count_layer)
    _WATCHED.add(model)


@contextmanager
def cancellable(event: threading.Event, progress: Progress | None = None) -> Iterator[None]:
    """Forwards of this thread inside the block stop at the next layer once ``event`` is set, and
    count the layers they finish in ``progress``."""
    token = _WATCH.set(_Watch(event, progress))
    try:
        yield
    finally:
        _WATCH.reset(token)
