"""Benchmark prompts: natural text (the KJV Book of Genesis shipped with the package), for
``criticalkv bench`` (:func:`bench_prompts`) and the decode scripts of ``benchmarks/`` (:func:`prompt_ids`)."""

from __future__ import annotations

from typing import Any

import torch

from criticalkv.headscores.haystack import essay_sentences, essay_words


def bench_prompts(tokenizer: Any, length: int, batch_size: int) -> torch.Tensor:
    """(batch_size, length) token ids: consecutive ``length``-token slices of the text, one per row
    (the text is repeated if it is too short), so rows differ but have no padding."""
    if length < 1 or batch_size < 1:
        raise ValueError("length and batch_size must be positive")
    ids: list[int] = list(tokenizer(" ".join(essay_words()), add_special_tokens=False)["input_ids"])
    need = length * batch_size
    while len(ids) < need:
        ids = ids + ids
    rows = [ids[i * length : (i + 1) * length] for i in range(batch_size)]
    return torch.tensor(rows, dtype=torch.long)


def prompt_ids(tokenizer: Any, tokens: int) -> torch.Tensor:
    """(1, tokens) token ids: the first ``tokens`` tokens of the natural-text haystack's sentences
    (Genesis, KJV), the prompt of ``benchmarks/``'s decode scripts."""
    text = " ".join(essay_sentences(tokens * 2))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < tokens:
        raise ValueError(f"the haystack gave only {len(ids)} tokens")
    return torch.tensor([ids])
