"""Running the app under uvicorn and saying where it listens once it does."""

from __future__ import annotations

import socket
from typing import Any

import uvicorn


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that prints ``listening on http://HOST:PORT`` once its sockets are bound
    (the real port when ``--port 0`` asked for any free one)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(f"listening on {self.url()}", flush=True)

    def url(self) -> str:
        """The address clients reach, ``http://HOST:PORT``."""
        port = self.config.port
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                port = sock.getsockname()[1]
                break
        host = self.config.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_app(app: Any, host: str, port: int) -> None:
    """Serve ``app`` on ``host:port`` until interrupted, announcing the address once it listens."""
    AnnouncingServer(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()
