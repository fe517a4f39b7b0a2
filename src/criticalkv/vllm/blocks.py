"""The scheduler's side: a KV cache spec that carries the plugin's options, and the block manager
that gives a compressed request's freed blocks back to vLLM's pool.

Both plug into vLLM's ``KVCacheSpecRegistry`` (written against vLLM 0.32): the worker reports its
attention layers with :class:`EvictingAttentionSpec` (a ``FullAttentionSpec`` that also names the
method, budget and window), and vLLM builds an :class:`EvictingManager` for them. The manager is
vLLM's full-attention manager plus one rule: once a request's prompt is processed, the blocks of
:func:`~criticalkv.vllm.plugin_options.freed_blocks` are freed and the null block takes their place, as
vLLM's own sliding-window managers do for the blocks a window left behind.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from criticalkv.vllm.plugin_options import PluginOptions, freed_blocks, kept_entries

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EvictingAttentionSpec(FullAttentionSpec):
    """Full attention whose requests keep only what the plugin's method selects (see the module).

    ``criticalkv`` holds the options as :meth:`PluginOptions.text` (a string: vLLM hashes and
    pickles specs)."""

    criticalkv: str

    @classmethod
    def wrap(cls, spec: FullAttentionSpec, options: PluginOptions) -> EvictingAttentionSpec:
        """``spec`` (one layer's full attention) with the plugin's ``options``."""
        return cls(**_fields_of(spec), criticalkv=options.text())

    @classmethod
    def merge(cls, specs: list[Any]) -> EvictingAttentionSpec:
        texts = {spec.criticalkv for spec in specs}
        if len(texts) != 1:
            raise ValueError(f"the attention layers of one KV cache group carry different criticalkv options: {texts}")
        base = FullAttentionSpec.merge(specs)
        return cls(**_fields_of(base), criticalkv=texts.pop())


def _fields_of(spec: FullAttentionSpec) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init}


class EvictingManager(FullAttentionManager):
    """vLLM's full-attention block manager that frees a compressed request's evicted blocks."""

    def __init__(self, kv_cache_spec: EvictingAttentionSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.cache_spec = PluginOptions.from_text(kv_cache_spec.criticalkv).spec()
        #: blocks given back to the pool so far (for the logs and the tests)
        self.blocks_freed = 0

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free the request's evicted blocks once its whole prompt is processed (the worker compressed
        it in the step that finished the prompt, before that step's tokens count as processed)."""
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        if num_prompt_tokens is None or processed_computed_tokens < num_prompt_tokens:
            return
        kept = kept_entries(self.cache_spec, num_prompt_tokens)
        if kept == num_prompt_tokens:
            return
        first, last = freed_blocks(kept, num_prompt_tokens, self.block_size)
        blocks = self.req_to_blocks.get(request_id, [])
        if first >= last or len(blocks) < last or blocks[last - 1] == self._null_block:
            return
        # vLLM's own helper (as its sliding-window managers use it): frees [first, last), puts the null block there
        self._remove_blocks_in_range(request_id, first, last)
        self.blocks_freed += last - first
        logger.debug(
            "request %s: kept %d of %d entries, freed blocks [%d, %d)", request_id, kept, num_prompt_tokens, first, last
        )


def register() -> None:
    """Map :class:`EvictingAttentionSpec` to :class:`EvictingManager` in vLLM's registry (idempotent).

    vLLM fills its registry with the built-in specs only while it is empty, so they are registered
    first (``_ensure_registered``, vLLM 0.32), then ours beside them."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(EvictingAttentionSpec, EvictingManager, uniform_type_base_spec=FullAttentionSpec)


def is_full_attention(spec: object) -> bool:
    """Whether a layer's vLLM spec is plain full attention (the only kind the plugin compresses)."""
    return type(spec) is FullAttentionSpec


register()
