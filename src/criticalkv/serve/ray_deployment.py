"""The server as a Ray Serve deployment (``criticalkv serve --ray``).

The same FastAPI app (:func:`~criticalkv.serve.app.build_app`) runs in every replica, built
at replica start (``serve.ingress()`` with ``__serve_build_asgi_app__``) around an
:class:`~criticalkv.serve.engine.Engine` whose model the replica loads once. The replicas
share the stored contexts through one folder (``--store``): a context created through one
replica is written there before it is acknowledged, and any other replica reads it back on
the first request that names it (:class:`~criticalkv.serve.store.ContextStore`).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from ray import serve

from criticalkv.serve.app import build_app
from criticalkv.serve.config import ServerConfig
from criticalkv.serve.engine import Engine

logger = logging.getLogger(__name__)

APP_NAME = "criticalkv"


@serve.ingress()
class CriticalKVReplica:
    """One replica: the model (loaded once), its engine, and the app around them."""

    def __init__(self, config: ServerConfig, model: str, device: str | None, dtype: str | None) -> None:
        from criticalkv.models import load_model

        loaded, tokenizer = load_model(model, device=device, dtype=dtype)
        self.engine = Engine(loaded, tokenizer, config)

    def __serve_build_asgi_app__(self) -> Any:
        return build_app(self.engine)


def build_application(
    config: ServerConfig,
    model: str,
    *,
    device: str | None = None,
    dtype: str | None = None,
    replicas: int = 1,
    num_cpus: float = 1.0,
) -> Any:
    """The bound Ray Serve application: ``replicas`` copies of the server over ``config.store``.

    Parameters
    ----------
    config
        The server's settings; ``config.store`` must be a folder every replica can read and write.
    model
        What :func:`criticalkv.load_model` loads in each replica (a name or a folder).
    replicas, num_cpus
        How many replicas, and the CPUs Ray reserves for each.
    """
    if config.store is None:
        raise ValueError("the Ray deployment needs --store: a folder every replica can read and write")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, not {replicas!r}")
    if not num_cpus > 0:
        raise ValueError(f"num_cpus must be positive, not {num_cpus!r}")
    deployment = serve.deployment(
        name="CriticalKVReplica",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": num_cpus},
        max_ongoing_requests=max(config.max_sessions, 1),
    )(CriticalKVReplica)
    return deployment.bind(config, model, device, dtype)


def start(application: Any, host: str, port: int) -> None:
    """Run ``application`` on the connected Ray cluster, its HTTP proxy on ``host:port`` (returns once up)."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
    logger.info("Ray Serve: %s on http://%s:%d", APP_NAME, host, port)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _interrupt_on_signals() -> None:
    """Make SIGINT and SIGTERM stop :func:`serve_forever` cleanly.

    A process started in the background by a non-interactive shell (``cmd &`` in a script, as
    CI runners and init scripts do) inherits SIGINT as *ignored*, and Python then keeps it
    ignored: Ctrl-C or ``kill -INT`` would do nothing and the cluster would be left running.
    """
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_interrupt)


def serve_forever(application: Any, host: str, port: int, address: str = "local") -> None:
    """Start a local Ray cluster (or join ``address``), run ``application`` until interrupted.

    On Ctrl-C a local cluster is shut down with everything on it; on a joined cluster only
    this application is deleted.
    """
    import ray

    _interrupt_on_signals()
    local = address == "local"
    if local:
        ray.init(address=address, include_dashboard=False)
    else:
        ray.init(address=address)
    _interrupt_on_signals()  # again: Ray's core worker put its own SIGTERM handler, which aborts the driver
    try:
        start(application, host, port)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        logger.info("stopping the Ray Serve deployment")
    finally:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
