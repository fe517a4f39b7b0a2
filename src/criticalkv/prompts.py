"""Turning (context, question) pairs into token ids, with the context as a prefix."""

from __future__ import annotations

import secrets

import torch
from transformers import PreTrainedTokenizerBase

_SENTINEL = "\u2063CRITICALKV_SPLIT\u2063"


def unused_marker(base: str, *texts: str) -> str:
    """``base``, or, if one of ``texts`` holds it (a user's document quoting it), ``base`` with a
    random suffix none of them holds: a text never collides with the marker that splits it."""
    marker = base
    while any(marker in text for text in texts):
        marker = f"{base[:-1]}_{secrets.token_hex(8)}{base[-1]}"
    return marker


def _bos_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """The BOS token's text if the tokenizer adds one by default (as a raw prompt gets), else ``""``."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    ids = tokenizer("a")["input_ids"]
    return str(bos) if ids and ids[0] == bos_id else ""


def split_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str,
    chat: bool = True,
    answer_prefix: str = "",
    verbatim: bool = False,
) -> tuple[str, str]:
    """The prompt text as (context part, question part); their concatenation is the prompt.

    With a chat template the user turn is ``context + "\\n\\n" + question`` and the question
    part ends with the assistant header followed by ``answer_prefix``. Without one:
    ``context + "\\n\\n" + question + "\\n" + (answer_prefix or "Answer:")``.
    ``verbatim`` (a benchmark's own template, e.g. LongBench's): the user turn is
    ``context + question``; without a chat template the prompt is the tokenizer's BOS text (if
    it adds one) ``+ context + question + answer_prefix``.
    """
    if chat and getattr(tokenizer, "chat_template", None):
        separator = "" if verbatim else "\n\n"
        marker = unused_marker(_SENTINEL, context, question)
        messages = [{"role": "user", "content": context + marker + separator + question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str) or text.count(marker) != 1:
            raise ValueError("the tokenizer's chat template does not render the user message verbatim")
        head, tail = text.split(marker)
        return head, tail + answer_prefix
    if verbatim:
        return _bos_text(tokenizer) + context, question + answer_prefix
    return context, "\n\n" + question + "\n" + (answer_prefix or "Answer:")


def encode_pair(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str,
    chat: bool = True,
    answer_prefix: str = "",
    verbatim: bool = False,
) -> tuple[list[int], list[int]]:
    """Token ids of the context part and the question part (tokenised separately)."""
    if not isinstance(context, str) or not context.strip():
        raise ValueError("the context is empty; pass the text to compress")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question is empty; pass the question to ask about the context")
    head, tail = split_prompt(tokenizer, context, question, chat, answer_prefix, verbatim)
    ctx = tokenizer(head, add_special_tokens=False)["input_ids"]
    qst = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return list(ctx), list(qst)


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``input_ids`` and ``attention_mask`` (B, T_max)."""
    if not sequences:
        raise ValueError("no sequences to pad")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq) :] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch (as ``generate`` computes them)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
