"""The cache's options as text or loose values give them (lm-eval's ``model_args``, a request's
JSON, a config file), converted once and strictly for :meth:`~criticalkv.cache.CacheSpec.of`.

Every entry point that takes the options from outside Python's type system calls
:func:`spec_keywords`: an option is used as given or refused in one sentence, never replaced.
An integer option takes an integer (``"32"`` or ``32``; never ``1.5``, ``32.0`` or ``True``), a
budget a fraction or a token count (``"0.2"``, ``"512"``). The ranges, and an option that
modifies another given without it, are :meth:`CacheSpec.of`'s checks, which every entry point
shares too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from criticalkv.defaults import SPEC_OPTIONS
from criticalkv.options import OptionTypeError

#: the options that take a whole number
INTEGER_OPTIONS: tuple[str, ...] = tuple(name for name in SPEC_OPTIONS if name not in ("method", "budget"))
#: what stands for "not given" in text (lm-eval's ``key=None``, an empty value)
NOT_GIVEN: tuple[str, ...] = ("None", "none", "null", "")
_INTEGER = re.compile(r"[+-]?\d+")


def given(value: Any) -> bool:
    """Whether ``value`` is an option's value rather than "not given" (``None``, ``"None"``, ``""``)."""
    return value is not None and not (isinstance(value, str) and value.strip() in NOT_GIVEN)


def integer_option(name: str, value: Any) -> int:
    """``value`` as an ``int``: an int or the text of one (``"32"``); anything else is refused."""
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        return int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(
            f"<{name}> must be a whole number, not {{value!r}}; it is used as given, never rounded", value=value
        )
    return value


def budget_option(value: Any) -> int | float:
    """A budget as given: an int (or ``"512"``) is a token count, a float (or ``"0.2"``) a fraction."""
    if isinstance(value, str):
        text = value.strip()
        if _INTEGER.fullmatch(text):
            return int(text)
        try:
            return float(text)
        except ValueError:
            raise OptionTypeError(
                "<budget> {value!r} is neither a fraction like 0.2 nor a token count like 512", value=value
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionTypeError("<budget> must be a fraction in (0, 1] or a token count, not {value!r}", value=value)
    return value


def method_option(value: Any) -> str:
    """A method's name (a non-empty string)."""
    if not isinstance(value, str) or not value.strip():
        raise OptionTypeError("<method> must be a method's name (see criticalkv methods), not {value!r}", value=value)
    return value.strip()


def spec_keywords(options: Mapping[str, Any]) -> dict[str, Any]:
    """The :meth:`CacheSpec.of` keywords of the cache options given in ``options`` (names of
    :data:`~criticalkv.defaults.SPEC_OPTIONS`; a value that is not given is left out, so the
    caller's default applies), each converted strictly (see the module).

    Raises
    ------
    OptionError
        naming the option: a value of the wrong kind (:meth:`CacheSpec.of` checks the rest).
    """
    unknown = sorted(set(options) - set(SPEC_OPTIONS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)} is not a cache option; they are {', '.join(SPEC_OPTIONS)}")
    keywords: dict[str, Any] = {}
    for name, value in options.items():
        if not given(value):
            continue
        if name == "method":
            keywords[name] = method_option(value)
        elif name == "budget":
            keywords[name] = budget_option(value)
        else:
            keywords[name] = integer_option(name, value)
    return keywords


#: :func:`spec_keywords`' and :meth:`CacheSpec.of`'s sentence for an interval without a decode budget
INTERVAL_WITHOUT_BUDGET = (
    "<decode_interval> re-selects under a decode budget, and none is given: give <decode_budget> too, "
    "or drop <decode_interval>"
)


def storage_without_bits(name: str) -> str:
    """The sentence for a storage option (the group size or the residual) given for storage that is not quantized."""
    return (
        f"<{name}> sets how <kv_bits> quantizes, and the storage is not quantized: give <kv_bits> 8 or 4 "
        f"too, or drop <{name}>"
    )
