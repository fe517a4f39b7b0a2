"""Compression methods: the :class:`Method` template, its registry and binding to a model.

Importing this package registers the built-in methods (:mod:`criticalkv.methods.catalog`).
"""

from criticalkv.methods import catalog as _catalog  # noqa: F401  (registers the built-in methods)
from criticalkv.methods.binding import HeadScoresArg, bind
from criticalkv.methods.method import Method
from criticalkv.methods.registry import available_methods, get_method, method_colour, register

__all__ = ["HeadScoresArg", "Method", "available_methods", "bind", "get_method", "method_colour", "register"]
