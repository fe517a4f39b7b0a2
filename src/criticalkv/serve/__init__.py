"""An OpenAI-compatible HTTP server over compressed, stored contexts (``criticalkv serve``).

* :mod:`~criticalkv.serve.app`: the FastAPI application; :mod:`~criticalkv.serve.routes`: one module per
  endpoint; :mod:`~criticalkv.serve.prepare`: the checks every request gets;
* :mod:`~criticalkv.serve.engine`: the model, admission and the worker thread;
  :mod:`~criticalkv.serve.session`: one answer decoded step by step;
* :mod:`~criticalkv.serve.store`: stored contexts under a memory cap, spilled to disk;
* :mod:`~criticalkv.serve.metrics`: ``/metrics`` in Prometheus' text format.
"""

from criticalkv.serve.app import build_app
from criticalkv.serve.config import ServerConfig, check_binding
from criticalkv.serve.engine import Engine

__all__ = ["Engine", "ServerConfig", "build_app", "check_binding"]
