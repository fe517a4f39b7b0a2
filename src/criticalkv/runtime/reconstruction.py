"""KVzip's context reconstruction: after a captured prefill, teacher-force a repeat prompt and the
prompt's own tokens on the full cache and record the attention every prompt entry receives (Kim et
al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416).

The cost is about one more prefill of the prompt: its tokens go through the model once more, in
chunks of ``chunk`` tokens, each chunk attending to the whole prompt (the full cache is held, plus
one chunk's keys and values at a time).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from criticalkv.cache.prefill import ReconstructionCache
from criticalkv.compat import cache_argument
from criticalkv.prompts import left_pad, positions, split_prompt
from criticalkv.runtime.attach import attach
from criticalkv.runtime.limits import check_positions
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)

#: the paper's and kvpress's reconstruction instruction
REPEAT_INSTRUCTION = "Repeat the previous context exactly."
#: repeated tokens per pass (kvpress's chunk size)
DEFAULT_CHUNK = 2048
#: a pass after the first starts with this many of the previous chunk's last tokens (kvpress's 8)
CUE_TOKENS = 8


@dataclass(frozen=True)
class RepeatPrompt:
    """What a reconstruction pass feeds after the prompt: ``ids`` (the instruction, ending the user
    turn and opening the assistant's with a chat template), then each row's real prompt tokens
    after its first ``skip`` (the chat template's opening, not repeated), ``chunk`` tokens a pass."""

    ids: tuple[int, ...]
    skip: int = 0
    chunk: int = DEFAULT_CHUNK

    def __post_init__(self) -> None:
        if not self.ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in self.ids):
            raise ValueError("the repeat prompt needs at least one token id (ints)")
        for name, low in (("skip", 0), ("chunk", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"the repeat prompt's {name} must be an integer >= {low}, not {value!r}")


def repeat_prompt(tokenizer: Any, chat: bool = True, chunk: int = DEFAULT_CHUNK) -> RepeatPrompt:
    """The repeat prompt for ``tokenizer``: ``"\\n\\n" + REPEAT_INSTRUCTION``, closed as a user turn
    followed by the assistant header when ``chat`` and the tokenizer has a chat template (the tokens
    of the template's opening are then not repeated), else followed by ``"\\n"`` (kvpress's choice)."""
    if chat and getattr(tokenizer, "chat_template", None):
        head, tail = split_prompt(tokenizer, "", REPEAT_INSTRUCTION, chat=True)
        skip = len(tokenizer(head, add_special_tokens=False)["input_ids"])
    else:
        tail, skip = "\n\n" + REPEAT_INSTRUCTION + "\n", 0
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return RepeatPrompt(tuple(int(i) for i in ids), skip, chunk)


def _passes(rows: Sequence[list[int]], prompt: RepeatPrompt) -> list[list[list[int]]]:
    """Per pass, per row: the prompt ids, the cue, then the row's next chunk of repeated tokens."""
    n_passes = max(1, max((len(row) - 1) // prompt.chunk + 1 for row in rows))
    out = []
    for p in range(n_passes):
        start = p * prompt.chunk
        cue = [row[max(0, start - CUE_TOKENS) : start] for row in rows]
        out.append([list(prompt.ids) + c + row[start : start + prompt.chunk] for c, row in zip(cue, rows, strict=True)])
    return out


@torch.no_grad()
def reconstruct(
    model: Any,
    states: Sequence[LayerState],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt: RepeatPrompt,
) -> list[LayerState]:
    """``states`` (a captured prefill of ``input_ids``, every layer) with
    :attr:`~criticalkv.state.LayerState.reconstruction` set: per query head, the most attention each
    entry receives while the model is teacher-forced on ``prompt`` then the row's own prompt tokens.

    Rows are left-padded; each row repeats its own real tokens (padding inside an appended pass is
    masked like the prompt's). The captured keys and values are not modified.
    """
    if not isinstance(prompt, RepeatPrompt):
        kind = type(prompt).__name__
        raise TypeError(f"prompt must be a RepeatPrompt (criticalkv.runtime.repeat_prompt), not {kind}")
    if len(states) != model.config.num_hidden_layers:
        raise ValueError(f"got {len(states)} layer states for a model of {model.config.num_hidden_layers} layers")
    mask = attention_mask.bool()
    rows = []
    for ids, real in zip(input_ids.tolist(), mask.tolist(), strict=True):
        tokens = [t for t, keep in zip(ids, real, strict=True) if keep]
        rows.append(tokens[prompt.skip :] if len(tokens) > prompt.skip else tokens)
    passes = _passes(rows, prompt)
    check_positions(
        model,
        int(input_ids.shape[1]) + max(len(piece) for piece in passes[0]),
        what="the prompt plus its reconstruction pass",
        fix="shorten the input, or a smaller RepeatPrompt chunk",
    )
    attach(model)
    cache = ReconstructionCache(states)
    for pieces in passes:
        ids, piece_mask = left_pad(pieces, 0)
        full_mask = torch.cat([attention_mask, piece_mask.to(attention_mask)], dim=1)
        model(
            input_ids=ids.to(input_ids.device),
            attention_mask=full_mask,
            position_ids=positions(full_mask)[:, -ids.shape[1] :],
            **cache_argument(model, cache),
            logits_to_keep=1,
        )
        cache.rewind()
    logger.debug("reconstruction: %d pass(es) of up to %d tokens", len(passes), prompt.chunk)
    return cache.states()
