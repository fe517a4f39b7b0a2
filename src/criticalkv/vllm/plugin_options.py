"""The plugin's options: which method, budget and window a vLLM engine compresses with, checked once.

They travel inside vLLM's own configuration, ``additional_config={"criticalkv": {...}}``, so the
engine's scheduler (which frees blocks) and its worker (which selects and moves entries) read the
same values; both turn them into a :class:`~criticalkv.cache.CacheSpec` with :meth:`PluginOptions.spec`
and ask it how many entries a prompt keeps (:func:`kept_entries`), so the two sides always agree.
This module imports no vLLM: the options are checked before an engine starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from criticalkv.budgets.resolve import Budget
from criticalkv.budgets.uniform import Uniform
from criticalkv.cache.prefill import DEFAULT_WINDOW
from criticalkv.cache.spec import CacheSpec
from criticalkv.methods import Method, available_methods, get_method
from criticalkv.options import OptionError, OptionTypeError

#: the key of vLLM's ``additional_config`` that holds the plugin's options
CONFIG_KEY = "criticalkv"
#: the plugin's default method: the paper's CriticalKV selection with equal budgets per head.
#: The library's default (``layer-defensivekv``) varies the budget over heads and layers, which one
#: block table per request cannot hold (docs/vllm.md, "What runs inside vLLM")
DEFAULT_VLLM_METHOD = "critical-snapkv"
DEFAULT_BUDGET: Budget = 0.2
_KEYS = ("method", "budget", "window")


def unsupported_reason(method: Method) -> str | None:
    """Why ``method`` cannot run inside vLLM's paged cache, or ``None`` when it can.

    A request has one block table shared by every layer and KV head, so each (layer, head) must keep
    the same number of entries (``Uniform`` budgets); the scores must read only the observation
    window's queries (the worker captures those) and no second pass over the prompt.
    """
    if not method.compresses:
        return None
    needs = method.needs
    if needs.cross_layer or type(method.budgets) is not Uniform:
        return "its budgets vary over KV heads or layers, and a vLLM request has one block table for all of them"
    if needs.queries is not None:
        return "its scores read prompt queries beyond the observation window, which the plugin does not keep"
    if needs.reconstruction:
        return "it scores a second pass over the prompt (context reconstruction)"
    return None


def supported_methods() -> list[str]:
    """The registered methods the vLLM plugin runs (see :func:`unsupported_reason`)."""
    return [name for name in available_methods() if unsupported_reason(get_method(name)) is None]


@dataclass(frozen=True)
class PluginOptions:
    """What a vLLM engine compresses with: a registered method's name, a budget (a fraction of the
    prompt in (0, 1] or a token count per KV head) and the observation window (tokens)."""

    method: str = DEFAULT_VLLM_METHOD
    budget: Budget = DEFAULT_BUDGET
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise OptionTypeError("<method> must be a method name such as 'snapkv', not {method!r}", method=self.method)
        method = get_method(self.method)
        reason = unsupported_reason(method)
        if reason is not None:
            raise OptionError(
                "<method> {method!r} cannot run inside vLLM: {reason}; the plugin runs {supported}",
                method=self.method,
                reason=reason,
                supported=", ".join(supported_methods()),
            )
        self.spec()  # the budget and the window, checked as every cache spec is

    @classmethod
    def from_config(cls, additional_config: Mapping[str, Any] | None) -> PluginOptions:
        """The options in vLLM's ``additional_config`` (its ``"criticalkv"`` entry; defaults without one)."""
        entry = (additional_config or {}).get(CONFIG_KEY, {})
        if isinstance(entry, str):
            entry = json.loads(entry)
        if not isinstance(entry, Mapping):
            raise OptionTypeError(
                "additional_config['criticalkv'] must be a mapping such as {{'method': 'snapkv', 'budget': 0.2}}, "
                "not {entry!r}",
                entry=entry,
            )
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown:
            raise OptionError(
                "additional_config['criticalkv'] has no option {unknown}; its options: {known}",
                unknown=", ".join(map(repr, unknown)),
                known=", ".join(_KEYS),
            )
        return cls(**entry)

    def spec(self) -> CacheSpec:
        """The cache spec of these options (the same parts as the transformers path), checked."""
        return CacheSpec.of(self.method, self.budget, self.window)

    def as_config(self) -> dict[str, dict[str, Any]]:
        """These options as vLLM's ``additional_config`` holds them."""
        return {CONFIG_KEY: asdict(self)}

    def text(self) -> str:
        """The options as one JSON line (what the plugin's cache spec carries to the scheduler)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> PluginOptions:
        return cls(**json.loads(text))


def kept_entries(spec: CacheSpec, prompt_tokens: int) -> int:
    """Entries every (layer, KV head) of a ``prompt_tokens``-token prompt holds after compression
    (the whole prompt when ``spec`` leaves it whole: see :meth:`CacheSpec.entries_per_head`)."""
    per_head = spec.entries_per_head(prompt_tokens)
    return prompt_tokens if per_head is None else per_head


def freed_blocks(kept: int, prompt_tokens: int, block_size: int) -> tuple[int, int]:
    """The request's logical blocks ``[first, last)`` that compression gives back to vLLM's pool.

    The kept entries move to the first ``ceil(kept / block_size)`` blocks; the next
    ``floor((prompt_tokens - kept) / block_size)`` blocks are freed (the null block takes their
    place in the scheduler's table, as for vLLM's sliding windows). A later token at position
    ``p`` is stored at cache index ``p - (prompt_tokens - kept)`` of the table without them, which
    the scheduler's allocation (by position) always covers: see docs/vllm.md.
    """
    if not 0 < kept <= prompt_tokens or block_size < 1:
        raise ValueError(f"cannot free blocks for {kept} kept entries of a {prompt_tokens}-token prompt")
    first = -(-kept // block_size)
    return first, first + (prompt_tokens - kept) // block_size
