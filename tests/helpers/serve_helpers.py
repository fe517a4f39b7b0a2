"""A live criticalkv server on 127.0.0.1 for the tests: uvicorn in a thread, a tiny model."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn

from criticalkv import attach
from criticalkv.cache import CacheSpec
from criticalkv.defaults import SPEC_OPTIONS
from criticalkv.serve import Engine, ServerConfig, build_app
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer

WINDOW = 8
BUDGET = 0.4
MAX_NEW = 12


def wait_until(condition: Callable[[], object], seconds: float = 60.0) -> bool:
    """Poll ``condition`` every 20 ms until it holds or ``seconds`` pass; whether it held. A bounded
    wait that a slow, loaded machine does not end early."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def idle(engine: Engine) -> bool:
    """Whether the server holds nothing: no request admitted or decoding, no prompt or context compressing."""
    return not (engine.active() or engine.admitted() or engine.compressor.pending() or engine.prompts.sessions)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def free_port() -> int:
    with free_socket() as sock:
        return int(sock.getsockname()[1])


def server_config(store: Path, **overrides: object) -> ServerConfig:
    """The test server's settings; the cache's options (``method``, ``budget``, ``window``, the
    storage's) among ``overrides`` build its default :class:`CacheSpec` (with :meth:`CacheSpec.of`)."""
    cache: dict[str, object] = dict(method="critical-adakv", budget=BUDGET, window=WINDOW)
    cache.update({name: overrides.pop(name) for name in SPEC_OPTIONS if name in overrides})
    settings: dict[str, object] = dict(
        model_name="tiny",
        spec=CacheSpec.of(**cache),  # type: ignore[arg-type]
        methods=("snapkv",),
        max_new_tokens=MAX_NEW,
        memory_cap_bytes=200_000,
        max_sessions=16,
        store=store,
    )
    settings.update(overrides)
    return ServerConfig(**settings)  # type: ignore[arg-type]


@contextmanager
def live_server(config: ServerConfig, model: Any = None, tokenizer: Any = None) -> Iterator[tuple[str, Engine]]:
    """``(base_url, engine)`` of a server answering on a free port of 127.0.0.1 (the tiny model
    and the character tokenizer unless ``model`` and ``tokenizer`` are given)."""
    model = attach(make_tiny("llama")) if model is None else model
    engine = Engine(model, char_tokenizer() if tokenizer is None else tokenizer, config)
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def document(seed: int, length: int = 240) -> str:
    """A reproducible printable document of ``length`` characters (one token each)."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "key", "value", "needle", "stack", "the", "of"]
    text = ""
    while len(text) < length:
        text += rng.choice(words) + rng.choice([" ", " ", ", ", ". "])
    return text[:length]


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def row_gauges(text: str) -> list[float]:
    """The per-row ``criticalkv_row_kv_bytes{row=...,context=...}`` values of a scrape."""
    return [float(line.split()[-1]) for line in text.splitlines() if line.startswith("criticalkv_row_kv_bytes{")]


def check_row_memory(text: str) -> tuple[int, float]:
    """One scrape's row memory, checked: the rows' own bytes plus their stored contexts' add up
    to ``criticalkv_rows_kv_bytes``, which stays within the cap. Returns (rows, their bytes)."""
    rows = row_gauges(text)
    total = metric(text, "criticalkv_rows_kv_bytes")
    assert sum(rows) + metric(text, "criticalkv_rows_context_kv_bytes") == total
    assert all(n > 0 for n in rows)  # every decode row holds a tail of its own
    assert total <= metric(text, "criticalkv_memory_cap_bytes"), text
    assert metric(text, "criticalkv_context_bytes_in_memory") <= metric(text, "criticalkv_memory_cap_bytes")
    return len(rows), total
