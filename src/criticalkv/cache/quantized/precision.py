"""The storage precision of a compressed cache: ``kv_bits``, its group size and its residual."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from criticalkv.cache.quantized.codec import SUPPORTED_BITS
from criticalkv.defaults import DEFAULT_GROUP_SIZES as DEFAULT_GROUP_SIZES
from criticalkv.defaults import DEFAULT_RESIDUAL as DEFAULT_RESIDUAL
from criticalkv.defaults import STORAGE_OPTIONS
from criticalkv.defaults import UNQUANTIZED_BITS as UNQUANTIZED_BITS
from criticalkv.options import OptionError, OptionTypeError


@dataclass(frozen=True)
class KVQuantization:
    """Kept entries stored in ``bits`` bits (Liu et al. 2024, KIVI, arXiv 2402.02750).

    Keys are quantized per channel over ``group_size`` consecutive kept entries of a head (a head's
    last block holds the rest, fewer, at their real length); values per token over
    ``min(group_size, head_dim)`` consecutive channels. The most recent ``residual`` appended
    tokens stay in full precision; older ones are quantized ``group_size`` at a time.
    ``group_size=None`` means the bit width's default (:func:`default_group_size`: 32 at 8 bits,
    64 at 4 bits), resolved at construction, so ``KVQuantization(8) == KVQuantization(8, 32)``.
    ``residual=None`` means :data:`DEFAULT_RESIDUAL`, capped at the smallest per-head budget.
    """

    bits: int
    group_size: int = None  # type: ignore[assignment]  # None: the bit width's default, resolved below
    residual: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            raise OptionError("<kv_bits> must be 16 (not quantized), 8 or 4, not {bits!r}", bits=self.bits)
        if self.group_size is None:
            object.__setattr__(self, "group_size", default_group_size(self.bits))
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise OptionError(
                "the quantization group size (<kv_group_size>) must be a positive integer, not {group!r}",
                group=self.group_size,
            )
        if self.residual is not None and (
            isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0
        ):
            raise OptionError(
                "the full-precision residual (<kv_residual>) must be a non-negative integer, not {residual!r}",
                residual=self.residual,
            )

    def check_head_dim(self, head_dim: int) -> None:
        """A clear error if the group size neither divides the head dimension nor is a multiple of it."""
        if head_dim % self.group_size and self.group_size % head_dim:
            raise OptionError(
                "the quantization group size (<kv_group_size>) {group} does not divide the head dimension {dim}: "
                "pick a divisor of {dim} (e.g. {divisor}) or a multiple",
                group=self.group_size,
                dim=head_dim,
                divisor=_largest_divisor(head_dim, self.group_size),
            )
        if self.bits == 4 and head_dim % 2:
            raise OptionError(
                "4-bit storage (<kv_bits> 4) packs two channels a byte and needs an even head dimension, not {dim}",
                dim=head_dim,
            )

    def check_budget(self, budget_tokens: int) -> None:
        """A clear error if an explicit residual is longer than the smallest per-head budget."""
        if self.residual is not None and self.residual > budget_tokens:
            raise OptionError(
                "the full-precision residual ({residual} tokens) is longer than the budget ({budget} entries per "
                "head): pass <kv_residual> <= {budget} or a larger <budget>",
                residual=self.residual,
                budget=budget_tokens,
            )

    def residual_for(self, budget_tokens: int | None) -> int:
        """The residual in effect for a cache whose smallest per-head budget is ``budget_tokens``."""
        if self.residual is not None:
            return self.residual
        return DEFAULT_RESIDUAL if budget_tokens is None else min(DEFAULT_RESIDUAL, budget_tokens)


def default_group_size(bits: int) -> int:
    """The group size ``bits``-bit storage uses when none is given (:data:`DEFAULT_GROUP_SIZES`)."""
    if isinstance(bits, bool) or bits not in DEFAULT_GROUP_SIZES:
        raise OptionError("quantized storage has 8 or 4 bits (<kv_bits>), not {bits!r}", bits=bits)
    return DEFAULT_GROUP_SIZES[bits]


def _largest_divisor(n: int, at_most: int) -> int:
    return max(k for k in range(1, min(n, at_most) + 1) if n % k == 0)


def head_dim_of(config: Any) -> int | None:
    """The attention head dimension of a transformers config, where it can be read."""
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def quantization_for(
    kv_bits: int,
    group_size: int | None = None,
    residual: int | None = None,
    budget: int | float | None = None,
    config: Any = None,
) -> KVQuantization | None:
    """Validate the storage options; ``None`` for ``kv_bits`` 16 (the model's dtype, not quantized).

    ``group_size=None``: the bit width's default (:func:`default_group_size`).

    ``budget`` (a token count) and ``config`` (the model's) are checked when given, before any work.
    """
    if isinstance(kv_bits, bool) or not isinstance(kv_bits, int):
        raise OptionTypeError("<kv_bits> must be an integer (16, 8 or 4), not {bits!r}", bits=kv_bits)
    if kv_bits in UNQUANTIZED_BITS:
        return None
    if group_size is None:  # the bit width's default, resolved (and the width checked) by the spec
        spec = KVQuantization(kv_bits, residual=residual)
    else:
        spec = KVQuantization(kv_bits, group_size, residual)
    if isinstance(budget, int) and not isinstance(budget, bool):
        spec.check_budget(budget)
    head_dim = None if config is None else head_dim_of(config)
    if head_dim is not None:
        spec.check_head_dim(head_dim)
    return spec


def check_quantized_decode(spec: KVQuantization | None, decode_budget: int | None) -> None:
    """A clear error if an explicit residual is longer than the decode budget (before any work).

    Decode-time re-selection works on quantized storage: the layer's entries are dequantized to
    score them, and the kept ones quantized again (:mod:`~criticalkv.cache.decode.reselect`).
    """
    if spec is not None and decode_budget is not None and spec.residual is not None and spec.residual > decode_budget:
        raise OptionError(
            "the full-precision residual ({residual} tokens) is longer than the decode budget ({budget} entries "
            "per head): pass <kv_residual> <= {budget} or a larger <decode_budget>",
            residual=spec.residual,
            budget=decode_budget,
        )


def storage_options(spec: KVQuantization | None) -> dict[str, Any]:
    """The ``kv_bits``/``kv_group_size``/``kv_residual`` keywords that rebuild ``spec`` (empty: not
    quantized), as records and file headers store them (:func:`quantization_from_record` reads them)."""
    if spec is None:
        return {}
    return dict(zip(STORAGE_OPTIONS, (spec.bits, spec.group_size, spec.residual), strict=True))


def quantization_from_record(record: Mapping[str, Any], config: Any = None) -> KVQuantization | None:
    """The storage a record's ``kv_bits``/``kv_group_size``/``kv_residual`` fields describe (as
    :func:`storage_options` writes them); ``None`` when ``kv_bits`` is absent, ``None``, 16 or 32."""
    bits, group, residual = (record.get(name) for name in STORAGE_OPTIONS)
    if bits is None or bits in UNQUANTIZED_BITS:
        return None
    return quantization_for(bits, group, residual, config=config)


def bits_per_element(cache: Any) -> float | None:
    """Bits per key or value element a :class:`CompressedCache` holds now, scales, zero points
    and spare tail capacity included; ``None`` if it holds nothing."""
    entries, bytes_ = 0, 0
    for layer in cache.compressed_layers:
        if not layer.holds_prompt:
            continue
        entries += int(layer.kept_per_head().sum()) * layer.head_dim
        bytes_ += layer.nbytes()
    return 8.0 * bytes_ / (2 * entries) if entries else None
