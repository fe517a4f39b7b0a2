"""The registry of named compression methods."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from criticalkv.methods.method import Method

_REGISTRY: dict[str, Callable[[], Method]] = {}


def register(name: str, factory: Callable[[], Method]) -> None:
    """Register a method factory under ``name`` (replacing any earlier one).

    To change a parameter of a registered method, use ``get_method(name, **options)`` instead.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a method name must be a non-empty string, not {name!r}")
    if not callable(factory):
        raise TypeError(f"register({name!r}, ...) needs a factory that returns a Method, not {factory!r}")
    _REGISTRY[name] = factory


def available_methods() -> list[str]:
    """Registered method names, in registration order."""
    return list(_REGISTRY)


def get_method(name: str | Method, **options: Any) -> Method:
    """The method registered as ``name`` (a :class:`Method` is taken as is), with ``options``
    replacing parameters of its parts (see :meth:`Method.with_options`), e.g.
    ``get_method("critical-adakv", precision="exact")``."""
    if isinstance(name, Method):
        method = name
    elif isinstance(name, str) and name in _REGISTRY:
        method = _REGISTRY[name]()
    else:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(_REGISTRY)}")
    return method.with_options(**options) if options else method
