"""What a compressed cache is, in one frozen value: which entries it keeps (method, budget,
window), what it is held to while decoding (a decode budget), and how it stores them.

:class:`CacheSpec` is what :class:`~criticalkv.cache.CompressedCache` is built from and what the
runtime, the evaluation, the bench and the server pass on. :meth:`CacheSpec.of` builds one from
the public keyword arguments (``decode_budget``, ``kv_bits``, ...), checking every option before
any work; its errors are :class:`~criticalkv.options.OptionError`, which the command line spells
with its flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from criticalkv.budgets.resolve import Budget, resolve_budget, validate_budget
from criticalkv.cache.decode import DEFAULT_INTERVAL, check_decode_budget
from criticalkv.cache.prefill import DEFAULT_WINDOW, check_window
from criticalkv.cache.quantized import KVQuantization, check_quantized_decode, quantization_for
from criticalkv.cache.spec_options import INTERVAL_WITHOUT_BUDGET, spec_keywords
from criticalkv.defaults import DEFAULT_METHOD
from criticalkv.defaults import SPEC_OPTIONS as SPEC_OPTIONS
from criticalkv.methods import HeadScoresArg, Method, bind, get_method
from criticalkv.options import OptionError, OptionTypeError


@dataclass(frozen=True)
class DecodeBudget:
    """Hold the cache at ``budget`` entries per KV head on average while it decodes, re-selecting a
    layer once it grew ``interval`` entries per head beyond it
    (:class:`~criticalkv.cache.decode.DecodeCompression`)."""

    budget: int
    interval: int = DEFAULT_INTERVAL


@dataclass(frozen=True)
class CacheSpec:
    """A compressed cache's description (see the module). Build it with :meth:`of`, which checks it.

    ``method`` is a :class:`~criticalkv.methods.Method` (bound to a model, for head-prior methods,
    before a cache is built from the spec); ``budget`` a fraction of the prompt in (0, 1] or a
    token count per KV head; ``window`` the observation window; ``decode`` the decode budget or
    ``None`` (every generated entry kept); ``storage`` the quantization or ``None`` (the model's dtype).
    """

    method: Method
    budget: Budget = 0.2
    window: int = DEFAULT_WINDOW
    decode: DecodeBudget | None = None
    storage: KVQuantization | None = None

    @classmethod
    def of(
        cls,
        method: str | Method = DEFAULT_METHOD,
        budget: Budget = 0.2,
        window: int = DEFAULT_WINDOW,
        *,
        decode_budget: int | None = None,
        decode_interval: int = DEFAULT_INTERVAL,
        kv_bits: int = 16,
        kv_group_size: int | None = None,
        kv_residual: int | None = None,
        config: Any = None,
    ) -> CacheSpec:
        """The spec of the public keyword arguments, every option checked (``config``: the model's,
        to check the group size against its head dimension).

        A ``decode_interval`` other than the default without a ``decode_budget`` (it would be
        ignored) is refused. (A ``kv_group_size`` or ``kv_residual`` at 16 bits is accepted here, so
        code can sweep ``kv_bits`` with fixed storage options; :meth:`parse` and the command line
        refuse it.)

        Raises
        ------
        OptionError
            (a ``ValueError``; an :class:`~criticalkv.options.OptionTypeError` for a wrong type)
            naming the option, before any work.
        """
        if decode_budget is None and decode_interval != DEFAULT_INTERVAL:  # it would be ignored
            raise OptionError(INTERVAL_WITHOUT_BUDGET)
        decode = None if decode_budget is None else DecodeBudget(decode_budget, decode_interval)
        storage = quantization_for(kv_bits, kv_group_size, kv_residual, validate_budget(budget), config=config)
        return cls(get_method(method), budget, window, decode, storage)

    @classmethod
    def parse(
        cls, options: Mapping[str, Any], *, defaults: Mapping[str, Any] | None = None, config: Any = None
    ) -> CacheSpec:
        """The spec of options given as text or loose values (lm-eval's ``model_args``, a request's
        JSON): each converted strictly by :func:`~criticalkv.cache.spec_options.spec_keywords` (used
        as given or refused, never replaced), over ``defaults`` (keywords of :meth:`of`), then
        checked by :meth:`of`. The one validation every entry point shares."""
        return cls.of(**{**(defaults or {}), **spec_keywords(options)}, config=config)

    def __post_init__(self) -> None:
        if not isinstance(self.method, Method):
            raise OptionTypeError(
                "<method> of a CacheSpec is a Method, not {method!r}: build it with CacheSpec.of(name, ...)",
                method=self.method,
            )
        validate_budget(self.budget)
        check_window(self.window)
        if self.storage is not None and isinstance(self.budget, int):
            self.storage.check_budget(self.budget)
        check_quantized_decode(self.storage, None if self.decode is None else self.decode.budget)
        if self.decode is not None:
            check_decode_budget(self.method, self.window, self.decode.budget, self.decode.interval)

    @property
    def kv_bits(self) -> int:
        """The storage precision: 16 (the model's dtype) or the quantized bit width."""
        return 16 if self.storage is None else self.storage.bits

    def entries_per_head(self, tokens: int) -> int | None:
        """Entries each KV head keeps of a ``tokens``-token prompt, or ``None`` when this spec leaves
        such a prompt whole: the full cache, or a budget that cannot hold the observation window
        (or asks for more tokens than the prompt has)."""
        if not self.method.compresses:
            return None
        try:
            per_head = int(resolve_budget(self.budget, torch.tensor([tokens]), self.window)[0])
        except ValueError:
            return None
        return per_head if per_head < tokens else None

    def compresses_some(self, longest: int) -> bool:
        """Whether this spec compresses any prompt of at most ``longest`` tokens (a longer prompt
        only helps: the budget grows with it, the window does not)."""
        return self.entries_per_head(longest) is not None

    def with_method(self, method: Method) -> CacheSpec:
        """The same spec for ``method`` (e.g. the method bound to a model)."""
        return replace(self, method=method)

    def keywords(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`of` that rebuild this spec (the method as its name)."""
        return {"method": self.method.name, "budget": self.budget, "window": self.window, **self.options()}

    def options(self) -> dict[str, Any]:
        """The decode and storage keywords (``decode_budget`` ... ``kv_residual``) of this spec, as
        :func:`criticalkv.generate` and :class:`~criticalkv.cache.CompressedCache` take them."""
        decode = self.decode
        storage = self.storage
        return {
            "decode_budget": None if decode is None else decode.budget,
            "decode_interval": DEFAULT_INTERVAL if decode is None else decode.interval,
            "kv_bits": self.kv_bits,
            "kv_group_size": None if storage is None else storage.group_size,
            "kv_residual": None if storage is None else storage.residual,
        }


def bind_spec(spec: CacheSpec, model: Any, head_scores: HeadScoresArg = None) -> CacheSpec:
    """``spec`` with its method bound to ``model`` (head scores for head-prior methods, see
    :func:`criticalkv.methods.bind`); ``model`` may be a model or its config."""
    return spec.with_method(bind(spec.method, model, head_scores))
