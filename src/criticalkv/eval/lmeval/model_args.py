"""The ``model_args`` of lm-eval's ``criticalkv`` model: the accepted names, their checks, and the
cache spec they describe (checked before the model loads)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from criticalkv.cache import CacheSpec
from criticalkv.cache.spec_options import given, integer_option
from criticalkv.defaults import DEFAULT_METHOD, SPEC_OPTIONS
from criticalkv.runtime import DEFAULT_WINDOWS

logger = logging.getLogger(__name__)

#: the ``--model_args`` the ``criticalkv`` model takes: what to load, the cache options
#: (:data:`~criticalkv.defaults.SPEC_OPTIONS`), lm-eval's own settings (it also passes ``max_batch_size``)
MODEL_ARGS: tuple[str, ...] = (
    "pretrained",
    *SPEC_OPTIONS,
    "dtype",
    "device",
    "batch_size",
    "max_batch_size",
    "max_length",
)

#: the observation window of a question-aware prompt (the last ``window`` tokens of each request)
DEFAULT_WINDOW = DEFAULT_WINDOWS["question-aware"]
#: the cache options of a run whose ``model_args`` do not name them
LM_DEFAULTS: dict[str, Any] = {"method": DEFAULT_METHOD, "budget": 0.2, "window": DEFAULT_WINDOW}


@dataclass(frozen=True)
class LMEvalOptions:
    """The checked ``model_args``: what to load, the cache spec (not yet checked against the
    model: :func:`~criticalkv.cache.bind_spec` does once it is loaded), lm-eval's own settings."""

    pretrained: str
    spec: CacheSpec
    dtype: str | None
    device: str | None
    batch_size: int
    max_batch_size: int
    max_length: int | None

    @classmethod
    def parse(cls, **model_args: Any) -> LMEvalOptions:
        """The options of ``model_args``, or a ``ValueError`` naming what is wrong.

        An unknown name is refused with one sentence listing :data:`MODEL_ARGS`; the cache options
        are parsed and checked by :meth:`CacheSpec.parse` (without the model: the group size against
        the head dimension is checked once it is loaded).
        """
        unknown = sorted(set(model_args) - set(MODEL_ARGS))
        if unknown:
            raise ValueError(
                f"the criticalkv lm-eval model does not take {', '.join(unknown)}; its model_args are "
                f"{', '.join(MODEL_ARGS)}"
            )
        args = {k: v for k, v in model_args.items() if given(v)}
        cache = {name: args[name] for name in SPEC_OPTIONS if name in args}
        dtype = args.get("dtype")
        return cls(
            pretrained=str(args.get("pretrained", "default")),
            spec=CacheSpec.parse(cache, defaults=LM_DEFAULTS),  # checked before the model loads
            dtype=None if dtype in (None, "auto") else str(dtype),
            device=None if args.get("device") is None else str(args["device"]),
            batch_size=_batch_size(args.get("batch_size", 1)),
            max_batch_size=_positive("max_batch_size", args.get("max_batch_size", 64)),
            max_length=None if args.get("max_length") is None else _positive("max_length", args["max_length"]),
        )


def _positive(name: str, value: Any) -> int:
    """A positive whole number as given (``max_length=0`` or ``1.5`` refused, never replaced)."""
    number = integer_option(name, value)
    if number < 1:
        raise ValueError(f"{name} must be a positive whole number of tokens, not {value!r}")
    return number


def _batch_size(value: Any) -> int:
    """A positive batch size; lm-eval's ``auto`` is refused (its probe runs the uncompressed model
    on ``max_length``-token batches, which takes minutes on a CPU and measures the wrong model)."""
    if isinstance(value, str) and value.strip().startswith("auto"):
        raise ValueError(
            f"batch_size={value} is not supported by the criticalkv model (lm-eval's probe runs the "
            "uncompressed model on max_length-token batches, which the compressed cache never holds); "
            "pass a number, e.g. --batch_size 8"
        )
    try:
        size = integer_option("batch_size", value)
    except ValueError:
        raise ValueError(f"batch_size must be a positive integer, not {value!r}") from None
    if size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {value!r}")
    return size


def merged_args(model_args: dict[str, Any], additional: dict[str, Any] | None) -> dict[str, Any]:
    """``model_args`` with lm-eval's own settings (``batch_size``, ``max_batch_size``, ``device``)
    where ``model_args`` does not name them: lm-eval passes them always (its defaults included), so
    the name a user wrote in ``model_args`` wins, and a different value of lm-eval's is logged."""
    merged = dict(model_args)
    for name, value in (additional or {}).items():
        if value is None:
            continue
        if name not in merged:
            merged[name] = value
        elif str(merged[name]) != str(value):
            logger.info("model_args %s=%s wins over lm-eval's %s=%s", name, merged[name], name, value)
    return merged


def available_device(device: str | None) -> str | None:
    """``device``, or the CPU (with a log line) for a CUDA device on a machine without CUDA, as
    lm-eval's own ``hf`` model falls back (its ``--device`` defaults to ``cuda:0``)."""
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("device %s is not available (no CUDA on this machine); running on the CPU", device)
        return "cpu"
    return device


def check_compresses_some(spec: CacheSpec, max_length: int) -> None:
    """Refuse a compressing spec that can compress no prompt lm-eval can send (every prompt is cut
    to ``max_length`` tokens): the run would be the full cache's, labelled with the method."""
    if spec.method.compresses and not spec.compresses_some(max_length):
        raise ValueError(
            f"method={spec.method.name} with budget={spec.budget} and window={spec.window} compresses no prompt "
            f"of at most max_length={max_length} tokens (each head's budget must hold the window and be "
            "below the prompt), so every prompt would be kept whole; lower window or change budget"
        )
