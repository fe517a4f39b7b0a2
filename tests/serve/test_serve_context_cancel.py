"""A blocking ``POST /v1/contexts`` whose client hangs up cancels its compression, and a context
compressing in the background shows its progress in layers (issue 29)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from criticalkv.serve import Engine
from criticalkv.serve.cancel import requested
from tests.helpers.serve_helpers import document, idle, live_server, server_config, wait_until

COMPRESSOR = "criticalkv-compressor"
LAYERS = 3  # the tiny model's decoder layers


class Gate:
    """A hook before decoder layer ``layer`` of the server's model that, on the compression thread
    only, counts the forwards that reach it and holds the ``hold``-th of them (counting from 1)
    until the compression is asked to stop or :meth:`open` is called (60 s at most)."""

    def __init__(self, engine: Engine, layer: int, hold: int = 1) -> None:
        self.reached, self.hold = 0, hold
        self.entered, self.released = threading.Event(), threading.Event()
        self.saw_request = False
        self.handle = engine.model.get_decoder().layers[layer].register_forward_pre_hook(self.hook)

    def hook(self, _module: Any, _args: Any) -> None:
        if threading.current_thread().name != COMPRESSOR:
            return
        self.reached += 1
        if self.reached != self.hold:
            return
        self.entered.set()
        deadline = time.monotonic() + 60  # bounded: a server that never notices lets it go on
        while not self.released.is_set() and time.monotonic() < deadline:
            if requested():
                self.saw_request = True
                return
            time.sleep(0.01)

    def open(self) -> None:
        self.released.set()

    def remove(self) -> None:
        self.open()
        self.handle.remove()


def _post_then_hang_up(url: str, text: str, entered: threading.Event) -> None:
    """A real client: POST the document on a socket, and close it once the compression has started."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"text": text}).encode()
    head = f"POST /v1/contexts HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert entered.wait(timeout=60), "the compression never started"
    # the socket is closed here, mid-compression


def test_a_client_that_hangs_up_cancels_its_blocking_compression(tmp_path: Path) -> None:
    """Held before layer 0, the compression is asked to stop once its client has hung up; layer 2
    is never reached, nothing is stored or listed, and the compression thread goes on to the next."""
    with live_server(server_config(tmp_path)) as (url, engine):
        first, last = Gate(engine, layer=0), Gate(engine, layer=LAYERS - 1, hold=0)  # last: counts only
        try:
            _post_then_hang_up(url, document(7), first.entered)
            wait_until(lambda: idle(engine))
        finally:
            first.remove()
            last.remove()
        assert first.saw_request, "the server never asked the compression to stop"
        assert first.reached == 1 and last.reached == 0  # stopped before its last layer
        assert httpx.get(url + "/v1/contexts", timeout=10).json()["data"] == []
        assert engine.store.stats()["on_disk"] == 0 and engine.admitted() == 0
        after = httpx.post(url + "/v1/contexts", json={"text": document(8)}, timeout=60)
        assert after.status_code == 200 and after.json()["status"] == "ready"  # the thread moved on
        assert [c["id"] for c in httpx.get(url + "/v1/contexts", timeout=10).json()["data"]] == [after.json()["id"]]


def _held_info(url: str, engine: Engine, gate: Gate) -> tuple[str, dict[str, Any], dict[str, Any]]:
    started = httpx.post(url + "/v1/contexts", json={"text": document(9), "wait": False}, timeout=10)
    assert started.status_code == 202, started.text
    assert gate.entered.wait(timeout=60)
    context_id = started.json()["id"]
    return context_id, started.json(), httpx.get(f"{url}/v1/contexts/{context_id}", timeout=10).json()


def test_a_compressing_context_shows_the_layers_done(tmp_path: Path) -> None:
    """Held before layer 1, a background compression has finished one of the model's three layers."""
    with live_server(server_config(tmp_path)) as (url, engine):
        gate = Gate(engine, layer=1)
        try:
            context_id, first, held = _held_info(url, engine, gate)
        finally:
            gate.remove()
        assert first["layers_done"] == 0 and first["layers_total"] == LAYERS
        assert held["status"] == "compressing" and held["layers_done"] == 1 and held["layers_total"] == LAYERS
        wait_until(lambda: idle(engine))
        ready = httpx.get(f"{url}/v1/contexts/{context_id}", timeout=10).json()
        assert ready["status"] == "ready" and "layers_done" not in ready


def test_a_reconstruction_pass_counts_twice_the_layers(tmp_path: Path) -> None:
    """KVzip prefills the document, then runs its reconstruction pass: held before layer 0 the second
    time, the compression has done the three layers of its first pass, of six."""
    config = server_config(tmp_path, method="kvzip", methods=(), memory_cap_bytes=2_000_000)
    with live_server(config) as (url, engine):
        gate = Gate(engine, layer=0, hold=2)
        try:
            context_id, _, held = _held_info(url, engine, gate)
        finally:
            gate.remove()
        assert held["status"] == "compressing", held
        assert held["layers_done"] == LAYERS and held["layers_total"] == 2 * LAYERS
        wait_until(lambda: idle(engine))
        assert httpx.get(f"{url}/v1/contexts/{context_id}", timeout=10).json()["status"] == "ready"
