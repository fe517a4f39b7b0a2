"""The ``model_args`` of lm-eval's ``criticalkv`` model: the accepted names, their checks, and the
cache spec they describe (checked before the model loads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from criticalkv.cache import CacheSpec
from criticalkv.cache.decode import DEFAULT_INTERVAL
from criticalkv.defaults import DEFAULT_METHOD
from criticalkv.runtime import DEFAULT_WINDOWS

#: the ``--model_args`` the ``criticalkv`` model takes (lm-eval also passes ``max_batch_size``)
MODEL_ARGS: tuple[str, ...] = (
    "pretrained",
    "method",
    "budget",
    "window",
    "kv_bits",
    "kv_group_size",
    "decode_budget",
    "decode_interval",
    "dtype",
    "device",
    "batch_size",
    "max_batch_size",
    "max_length",
)

#: the observation window of a question-aware prompt (the last ``window`` tokens of each request)
DEFAULT_WINDOW = DEFAULT_WINDOWS["question-aware"]


def _none(value: Any) -> Any:
    """lm-eval parses ``key=None`` in ``--model_args`` as the string ``"None"``."""
    return None if value in (None, "None", "none", "") else value


@dataclass(frozen=True)
class LMEvalOptions:
    """The checked ``model_args``: what to load, the cache spec's keywords, lm-eval's own settings."""

    pretrained: str
    spec_keywords: dict[str, Any]
    dtype: str | None
    device: str | None
    batch_size: int | str
    max_batch_size: int
    max_length: int | None

    @classmethod
    def parse(cls, **model_args: Any) -> LMEvalOptions:
        """The options of ``model_args``, or a ``ValueError`` naming what is wrong.

        An unknown name is refused with one sentence listing :data:`MODEL_ARGS`; the cache options
        are checked by :meth:`CacheSpec.of` (without the model: the group size against the head
        dimension is checked once it is loaded).
        """
        unknown = sorted(set(model_args) - set(MODEL_ARGS))
        if unknown:
            raise ValueError(
                f"the criticalkv lm-eval model does not take {', '.join(unknown)}; its model_args are "
                f"{', '.join(MODEL_ARGS)}"
            )
        args = {k: _none(v) for k, v in model_args.items()}
        keywords: dict[str, Any] = {
            "method": str(args.get("method") or DEFAULT_METHOD),
            "budget": args.get("budget", 0.2) if args.get("budget") is not None else 0.2,
            "window": int(args.get("window") or DEFAULT_WINDOW),
            "kv_bits": int(args.get("kv_bits") or 16),
            "kv_group_size": args.get("kv_group_size"),
            "decode_budget": args.get("decode_budget"),
            "decode_interval": int(args.get("decode_interval") or DEFAULT_INTERVAL),
        }
        CacheSpec.of(**keywords)  # every cache option checked before the model loads
        dtype = args.get("dtype")
        return cls(
            pretrained=str(args.get("pretrained") or "default"),
            spec_keywords=keywords,
            dtype=None if dtype in (None, "auto") else str(dtype),
            device=None if args.get("device") is None else str(args["device"]),
            batch_size=_batch_size(args.get("batch_size", 1)),
            max_batch_size=int(args.get("max_batch_size") or 64),
            max_length=None if args.get("max_length") is None else int(args["max_length"]),
        )


def _batch_size(value: Any) -> int | str:
    """An integer batch size, or lm-eval's ``auto`` / ``auto:N``."""
    if value is None:
        return 1
    if isinstance(value, str) and value.startswith("auto"):
        return value
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"batch_size must be a positive integer or 'auto', not {value!r}") from None
    if size < 1:
        raise ValueError(f"batch_size must be a positive integer or 'auto', not {value!r}")
    return size
