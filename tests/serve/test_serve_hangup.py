"""A client that hangs up stops its request's work on every route (issue 41, section 3): a chat
answer (streamed or not) and a completion leave the batch at the next decode step, instead of
decoding to ``max_tokens`` for nobody. (``POST /v1/contexts``: tests/serve/test_serve_context_cancel.py.)"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from criticalkv.serve import Engine
from tests.helpers.serve_helpers import MAX_NEW, document, live_server, server_config

WORKER = "criticalkv-worker"


class SlowSteps:
    """A hook before decoder layer 0 that, on the decode worker only, counts the forwards and
    makes each take ``pause`` seconds, so that an answer of ``MAX_NEW`` tokens outlasts its client."""

    def __init__(self, engine: Engine, pause: float = 0.2) -> None:
        self.forwards, self.pause = 0, pause
        self.started = threading.Event()
        self.handle = engine.model.get_decoder().layers[0].register_forward_pre_hook(self.hook)

    def hook(self, _module: Any, _args: Any) -> None:
        if threading.current_thread().name != WORKER:
            return
        self.forwards += 1
        if self.forwards >= 2:
            self.started.set()  # the answer is decoding
        time.sleep(self.pause)


def _post_then_hang_up(url: str, path: str, body: dict[str, Any], started: threading.Event) -> None:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        assert started.wait(timeout=60), "the answer never started"
    # closed here, mid-answer


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": document(3, 60)}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": document(3, 60)}], "stream": True}),
        ("/v1/completions", {"prompt": document(4, 60)}),
        ("/v1/completions", {"prompt": document(4, 60), "echo": True, "logprobs": 1}),
    ],
)
def test_a_client_that_hangs_up_stops_its_answer(tmp_path: Path, path: str, body: dict[str, Any]) -> None:
    config = server_config(tmp_path, method="full", budget=1.0, max_new_tokens=MAX_NEW)
    with live_server(config) as (url, engine):
        steps = SlowSteps(engine)
        try:
            _post_then_hang_up(url, path, {"model": "tiny", "max_tokens": MAX_NEW, **body}, steps.started)
            deadline = time.monotonic() + 60
            while engine.admitted() and time.monotonic() < deadline:  # bounded: until the row has left
                time.sleep(0.02)
        finally:
            steps.handle.remove()
        assert engine.admitted() == 0 and engine.active() == 0
        # the prefill and a few steps, not the MAX_NEW - 1 decode steps an answer for nobody would take
        assert steps.forwards < MAX_NEW // 2, steps.forwards
