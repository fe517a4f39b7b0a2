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
from criticalkv.cache.quantized import (
    KVQuantization,
    check_quantized_decode,
    head_dim_of,
    quantization_for,
    storage_options,
)
from criticalkv.cache.spec_options import INTERVAL_WITHOUT_BUDGET, spec_keywords, storage_without_bits
from criticalkv.defaults import DEFAULT_METHOD, STORAGE_OPTIONS, UNQUANTIZED_BITS
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
        decode_interval: int | None = None,
        kv_bits: int = 16,
        kv_group_size: int | None = None,
        kv_residual: int | None = None,
        config: Any = None,
    ) -> CacheSpec:
        """The spec of the public keyword arguments, every option checked (``config``: the model's,
        to check the group size against its head dimension). ``None`` means "the default":
        ``decode_interval`` 64 (:data:`~criticalkv.cache.decode.DEFAULT_INTERVAL`), the bit width's
        group size, the default residual.

        An option that modifies another is refused without it (it would be ignored):
        ``decode_interval`` without ``decode_budget``, ``kv_group_size`` or ``kv_residual`` at 16 bits.

        Raises
        ------
        OptionError
            (a ``ValueError``; an :class:`~criticalkv.options.OptionTypeError` for a wrong type)
            naming the option, before any work.
        """
        if decode_budget is None and decode_interval is not None:
            raise OptionError(INTERVAL_WITHOUT_BUDGET)
        if kv_bits in UNQUANTIZED_BITS:
            for name, value in zip(STORAGE_OPTIONS[1:], (kv_group_size, kv_residual), strict=True):
                if value is not None:
                    raise OptionError(storage_without_bits(name))
        interval = DEFAULT_INTERVAL if decode_interval is None else decode_interval
        decode = None if decode_budget is None else DecodeBudget(decode_budget, interval)
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

    def replaced(
        self, *, method: str | Method | None = None, budget: Budget | None = None, window: int | None = None
    ) -> CacheSpec:
        """The same decode budget and storage with another method, budget or window (a sweep's row),
        checked as :meth:`of` checks them."""
        return replace(
            self,
            method=self.method if method is None else get_method(method),
            budget=self.budget if budget is None else budget,
            window=self.window if window is None else window,
        )

    def check_compressible(self, tokens: int, what: str = "prompt") -> int | None:
        """Entries each KV head keeps of a ``tokens``-token ``what`` (``None`` for a method that keeps
        everything), or :class:`PromptTooShort` when this spec cannot take it: fewer tokens than the
        observation window, a budget that cannot hold the window (or asks for more tokens than there
        are), or an explicit exact residual longer than each head's budget. The one check every
        entry point (``generate``, the server, lm-eval, the bench) runs before any work."""
        values = {"what": what, "tokens": tokens}
        if tokens < self.window:
            raise PromptTooShort(
                "the {what} has {tokens} tokens, fewer than the observation window ({window}); "
                "use a longer {what} or a smaller <window>",
                window=self.window,
                **values,
            )
        if not self.method.compresses:
            return None
        try:
            per_head = int(resolve_budget(self.budget, torch.tensor([tokens]), self.window)[0])
        except ValueError as error:
            raise PromptTooShort("the {what} has {tokens} tokens: {why}", why=str(error), **values) from None
        if self.storage is not None:
            try:
                self.storage.check_budget(per_head)
            except OptionError as error:
                raise PromptTooShort(
                    "the {what} has {tokens} tokens: " + error.template, **values, **error.values
                ) from None
        return per_head

    def compressible(self, tokens: int) -> bool:
        """Whether a ``tokens``-token prompt is compressed by this spec: its method compresses and
        :meth:`check_compressible` accepts it (a prompt it refuses is kept whole where an entry
        point keeps such prompts, e.g. lm-eval's short requests)."""
        if not self.method.compresses:
            return False
        try:
            self.check_compressible(tokens)
        except PromptTooShort:
            return False
        return True

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
        """The keyword arguments of :meth:`of` that rebuild this spec (the method as its name; the
        decode and storage keywords only where they are set)."""
        keywords: dict[str, Any] = {"method": self.method.name, "budget": self.budget, "window": self.window}
        if self.decode is not None:
            keywords.update(decode_budget=self.decode.budget, decode_interval=self.decode.interval)
        return {**keywords, **storage_options(self.storage)}

    def record(self) -> dict[str, Any]:
        """Every option as records store it (each of :data:`SPEC_OPTIONS`: ``decode_interval`` the
        default without a decode budget, ``kv_bits`` 16 and no group size or residual unquantized);
        :meth:`from_record` reads it back."""
        record = {**dict.fromkeys(SPEC_OPTIONS), "decode_interval": DEFAULT_INTERVAL, **self.keywords()}
        return {**record, STORAGE_OPTIONS[0]: self.kv_bits}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], config: Any = None) -> CacheSpec:
        """The spec a record's options describe (:meth:`record`'s fields, extra fields ignored;
        ``None`` is the default, ``kv_bits`` ``None`` the model's dtype)."""
        given = {name: record[name] for name in SPEC_OPTIONS if record.get(name) is not None}
        if given.get(STORAGE_OPTIONS[0], UNQUANTIZED_BITS[0]) in UNQUANTIZED_BITS:
            for name in STORAGE_OPTIONS:
                given.pop(name, None)
        if "decode_budget" not in given:
            given.pop("decode_interval", None)
        return cls.of(**given, config=config)


class PromptTooShort(OptionError):
    """A prompt a :class:`CacheSpec` cannot compress (see :meth:`CacheSpec.check_compressible`); an
    :class:`~criticalkv.options.OptionError`, so a command spells the options it names as its flags."""


def bind_spec(spec: CacheSpec, model: Any, head_scores: HeadScoresArg = None) -> CacheSpec:
    """``spec`` with its method bound to ``model`` (head scores for head-prior methods, see
    :func:`criticalkv.methods.bind`) and its storage checked against the model's head dimension
    (a spec parsed before the model loaded); ``model`` may be a model or its config."""
    head_dim = head_dim_of(getattr(model, "config", model))
    if spec.storage is not None and head_dim is not None:
        spec.storage.check_head_dim(head_dim)
    return spec.with_method(bind(spec.method, model, head_scores))
