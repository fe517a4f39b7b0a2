"""Benchmark prompts: natural text (the KJV Book of Genesis shipped with the package)."""

from __future__ import annotations

from typing import Any

import torch

from criticalkv.headscores.haystack import essay_words


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
