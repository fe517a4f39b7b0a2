"""Errors about an option that name it the way the caller spelled it.

The library's checks (:class:`~criticalkv.cache.spec.CacheSpec` and what it validates) raise
:class:`OptionError`: its message is written once as a template whose ``<name>`` markers are
option names. ``str(error)`` spells them as the Python keywords (``decode_budget``); the command
line asks for :meth:`OptionError.spelled` with its flags (``--decode-budget``). Nothing rewrites a
finished message.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_MARKER = re.compile(r"<([a-z_]+)>")


class OptionError(ValueError):
    """A bad value for an option, its message a template over option names (see the module)."""

    def __init__(self, template: str, **values: Any) -> None:
        self.template = template
        self.values = values
        #: the option names the message mentions, in order
        self.options = tuple(_MARKER.findall(template))
        super().__init__(self.spelled({}))

    def spelled(self, names: Mapping[str, str]) -> str:
        """The message with each option named as ``names`` says (a name it lacks: the keyword)."""
        text = _MARKER.sub(
            lambda m: names.get(m.group(1), m.group(1)).replace("{", "{{").replace("}", "}}"), self.template
        )
        return text.format(**self.values)


class OptionTypeError(OptionError, TypeError):
    """An option of the wrong type (a ``TypeError`` too)."""


def flag_spelling(*options: str, **overrides: str) -> dict[str, str]:
    """The command line's names of ``options``: ``decode_budget`` -> ``--decode-budget``, unless overridden."""
    names = {name: "--" + name.replace("_", "-") for name in options}
    names.update(overrides)
    return names
