"""Method specs: a registered name with options in one string, ``critical-snapkv:eps=0:alpha=0.25``.

The command line's ``--methods`` and every ``get_method`` call accept them; the method built from
a spec is named by the spec's canonical spelling (:func:`format_spec`, options sorted), so results
of two spellings of one configuration are the same method in a results folder.
"""

from __future__ import annotations

import math
from typing import Any

SEPARATOR = ":"


def _value(key: str, text: str) -> Any:
    """An option's value: ``true``/``false``, an integer, a float, else the text itself."""
    if not text:
        raise ValueError(f"option {key!r} has no value; write {key}=VALUE")
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            number = kind(text)
        except ValueError:
            continue
        if isinstance(number, float) and not math.isfinite(number):
            raise ValueError(f"option {key!r} must be a finite number, not {text!r}")
        return number
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value:..."`` -> ``(name, {key: value})``; a plain name has no options.

    Raises ``ValueError`` (with the expected form) for an empty part, a part without ``=`` or an
    option given twice.
    """
    if not isinstance(spec, str):
        raise TypeError(f"a method spec must be a string, not {type(spec).__name__}")
    name, *parts = spec.strip().split(SEPARATOR)
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, text = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"method spec {spec!r}: write options as NAME:KEY=VALUE[:KEY=VALUE...], not {part!r}")
        if key in options:
            raise ValueError(f"method spec {spec!r} gives option {key!r} twice")
        options[key] = _value(key, text.strip())
    return name.strip(), options


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def format_spec(name: str, options: dict[str, Any]) -> str:
    """The canonical spec of ``name`` with ``options``: options sorted, numbers in ``%g`` form."""
    return SEPARATOR.join([name, *(f"{key}={_text(options[key])}" for key in sorted(options))])
