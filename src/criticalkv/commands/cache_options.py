"""The cache's options on the command line, defined once for every command that builds a cache.

:func:`add_cache_arguments` declares ``--decode-budget``, ``--decode-interval``, ``--kv-bits``,
``--kv-group-size`` and ``--kv-residual`` (one definition, one default each);
:func:`spec_from_args` turns them, with a method, budget and window, into a checked
:class:`~criticalkv.cache.CacheSpec`. The library's :class:`~criticalkv.options.OptionError`
names options through its template, so a command's message names its flags
(:data:`FLAGS`, or a command's own ``SPELLING``) without rewriting any text.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from criticalkv.commands.common import UsageError
from criticalkv.defaults import DEFAULT_GROUP_SIZES, DEFAULT_INTERVAL, DEFAULT_RESIDUAL, SPEC_OPTIONS
from criticalkv.options import OptionError, flag_spelling

if TYPE_CHECKING:
    from criticalkv.cache import CacheSpec

#: the flags that spell the cache's options (``kv_residual`` -> ``--kv-residual``)
FLAGS: dict[str, str] = flag_spelling(*SPEC_OPTIONS)
#: the storage precisions ``--kv-bits`` takes (16: the model's dtype, not quantized)
KV_BITS = (16, 8, 4)


def group_size_defaults() -> str:
    """The default group size of each bit width, as the help strings say it: ``32 at 8 bits, 64 at 4 bits``."""
    return ", ".join(f"{group} at {bits} bits" for bits, group in DEFAULT_GROUP_SIZES.items())


def add_cache_arguments(p: argparse.ArgumentParser, *, decode: bool = True) -> None:
    """The storage options and, with ``decode``, the decode budget's (the server has none)."""
    if decode:
        p.add_argument(
            "--decode-budget",
            type=int,
            default=None,
            metavar="N",
            help="hold each cache at N entries per KV head while it decodes (default: keep every generated entry)",
        )
        p.add_argument(
            "--decode-interval",
            type=int,
            default=None,
            metavar="K",
            help=f"with --decode-budget: re-select after K new entries per head (default {DEFAULT_INTERVAL})",
        )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        default=16,
        help="store the kept entries in 8 or 4 bits (default 16: the model's dtype)",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        default=None,
        help=f"with --kv-bits 8 or 4: entries per scale and zero point (default {group_size_defaults()})",
    )
    p.add_argument(
        "--kv-residual",
        type=int,
        default=None,
        help=f"with --kv-bits 8 or 4: newest tokens kept exact (default min({DEFAULT_RESIDUAL}, budget))",
    )


def spec_from_args(args: argparse.Namespace, method: Any, budget: Any, window: int, *, config: Any = None) -> CacheSpec:
    """The checked spec of ``method`` at ``budget`` and ``window`` with the cache flags of ``args``
    (``config``: the model's, to check the group size); errors name the flags. A command that sweeps
    methods or budgets varies this spec with :meth:`CacheSpec.replaced`."""
    from criticalkv.cache import CacheSpec

    given = {name: getattr(args, name) for name in SPEC_OPTIONS if hasattr(args, name)}
    given.update(method=method, budget=budget, window=window)
    try:
        return CacheSpec.of(**{name: value for name, value in given.items() if value is not None}, config=config)
    except OptionError as error:
        raise UsageError(error.spelled(FLAGS)) from None
