"""What one perturbation results folder measures (:class:`RunSpec`): its identity on resume."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from criticalkv.cache.prefill import check_window


@dataclass(frozen=True)
class RunSpec:
    """What one output folder measures; every row in it shares these settings.

    Attributes
    ----------
    model : the model name given to :func:`criticalkv.load_model`.
    length : context length in tokens of each needle sample.
    window : observation window (question-aware: it holds the end of the question).
    seed : sample ``i`` is ``make_needle_sample(tokenizer, length, seed + i)``.
    chat : wrap the prompt in the tokenizer's chat template.
    """

    model: str
    length: int = 2048
    window: int = 32
    seed: int = 0
    chat: bool = True

    def __post_init__(self) -> None:
        check_window(self.window)
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 32:
            raise ValueError(f"length must be an integer of at least 32 tokens, not {self.length!r}")
        if self.window > self.length:
            raise ValueError(f"the window ({self.window}) is longer than the context ({self.length}); lower it")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
