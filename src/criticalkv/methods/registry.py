"""The registry of named compression methods."""

from __future__ import annotations

import dataclasses
from typing import Any

from criticalkv.methods.method import Method
from criticalkv.methods.spec_string import format_spec, parse_spec

_REGISTRY: dict[str, Method] = {}
#: each registered method's colour in every figure (``None``: a spare colour is picked for it)
_COLOURS: dict[str, str | None] = {}


def register(method: Method, *, colour: str | None = None) -> None:
    """Register ``method`` under its name (replacing any earlier method of that name), drawn in
    ``colour`` (a matplotlib colour, e.g. ``"#08519c"``) in every figure; without ``colour`` a
    method registered again keeps the colour it had.

    To change a parameter of a registered method, use ``get_method(name, **options)`` instead.
    """
    if not isinstance(method, Method):
        raise TypeError(f"register(...) needs a criticalkv Method, not {method!r}")
    if not isinstance(method.name, str) or not method.name:
        raise ValueError(f"a method name must be a non-empty string, not {method.name!r}")
    if colour is not None and (not isinstance(colour, str) or not colour):
        raise ValueError(f"a method's colour is a matplotlib colour such as '#08519c', not {colour!r}")
    _REGISTRY[method.name] = method
    _COLOURS[method.name] = colour if colour is not None else _COLOURS.get(method.name)


def method_colour(name: str) -> str | None:
    """The colour ``name`` was registered with (``None``: none given, or not a registered method)."""
    return _COLOURS.get(name)


def available_methods() -> list[str]:
    """Registered method names, in registration order."""
    return list(_REGISTRY)


def get_method(name: str | Method, **options: Any) -> Method:
    """The method registered as ``name`` (a :class:`Method` is taken as is), with ``options``
    replacing parameters of its parts (see :meth:`Method.with_options`), e.g.
    ``get_method("critical-adakv", precision="exact")``.

    ``name`` may be a spec with options, ``"critical-snapkv:eps=0:alpha=0.25"``
    (:mod:`criticalkv.methods.spec_string`): the method is then named by the spec's canonical spelling.
    """
    if isinstance(name, Method):
        method = name
    elif isinstance(name, str):
        base, spec_options = parse_spec(name)
        if base not in _REGISTRY:
            raise ValueError(f"unknown method {base!r}; choose one of: {', '.join(_REGISTRY)}")
        method = _REGISTRY[base]
        if spec_options:
            method = dataclasses.replace(method.with_options(**spec_options), name=format_spec(base, spec_options))
    else:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(_REGISTRY)}")
    return method.with_options(**options) if options else method
