"""One way to compress a prompt: prefill it, then keep what a :class:`~criticalkv.cache.CacheSpec` says.

Generation, the evaluation, the server and the bench all compress here, so what a method needs
from the prefill is read in this module alone (outside the cache): how many prompt queries its
scores read (``needs.queries``) and whether it scores a context-reconstruction pass
(``needs.reconstruction``, KVzip). A method with a new need touches its own file,
:mod:`criticalkv.needs` and this module.
"""

from __future__ import annotations

from typing import Any

import torch

from criticalkv.cache import CacheSpec, CompressedCache
from criticalkv.methods import Method
from criticalkv.needs import Needs
from criticalkv.runtime.forward import prefill, prefill_into
from criticalkv.runtime.reconstruction import RepeatPrompt
from criticalkv.scores.queries import resolve_num_queries
from criticalkv.state import LayerState


def compresses_in_prefill(method: Method) -> bool:
    """Whether ``method`` selects while the model prefills (layer by layer, the prompt never held
    whole), so a cache can be handed to ``model.generate`` empty; ``False`` for methods that score
    a pass after the prefill (KVzip's reconstruction), which :func:`compress_prompt` runs."""
    return not method.needs.reconstruction


@torch.no_grad()
def prompt_states(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    needs: Needs,
    *,
    window: int,
    reconstruction: RepeatPrompt | None = None,
) -> tuple[list[LayerState], torch.Tensor]:
    """The prefill's layer states as methods with ``needs`` read them, and the (B, V) last logits.

    The states keep as many prompt queries as ``needs.queries`` asks (the window at least); with
    ``needs.reconstruction`` the context-reconstruction pass runs too, with ``reconstruction``
    (:func:`~criticalkv.runtime.repeat_prompt`). Compress them, as often as wanted, with
    :meth:`CompressedCache.compress_states` or the batch helpers.
    """
    if needs.reconstruction and reconstruction is None:
        raise ValueError(
            "a method here scores a context-reconstruction pass (KVzip): pass reconstruction="
            "criticalkv.runtime.repeat_prompt(tokenizer, chat)"
        )
    queries = resolve_num_queries(needs.queries, int(input_ids.shape[1]))
    repeat = reconstruction if needs.reconstruction else None
    return prefill(model, input_ids, attention_mask, window=window, num_queries=queries, reconstruction=repeat)


@torch.no_grad()
def compress_prompt(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    spec: CacheSpec,
    *,
    reconstruction: RepeatPrompt | None = None,
    synchronize_timing: bool = False,
) -> tuple[CompressedCache, torch.Tensor]:
    """Prefill ``input_ids`` (B, T) and compress it as ``spec`` says (its method bound, see
    :func:`~criticalkv.cache.bind_spec`); returns the cache and the (B, V) logits after the last token.

    Methods that select during the prefill do so layer by layer (:func:`compresses_in_prefill`);
    methods that score a context-reconstruction pass (KVzip) get a captured prefill, the pass
    (with ``reconstruction``, required for them) and then the selection, as in the paper's code.
    ``synchronize_timing`` times each layer's selection exactly on a GPU (benchmarks).
    """
    cache = CompressedCache.from_spec(model.config.num_hidden_layers, spec)
    cache.synchronize_timing = synchronize_timing
    if compresses_in_prefill(spec.method):
        return cache, prefill_into(model, cache, input_ids, attention_mask)
    states, last = prompt_states(
        model, input_ids, attention_mask, spec.method.needs, window=spec.window, reconstruction=reconstruction
    )
    cache.compress_states(states)
    return cache, last
