"""Each token's piece of a text, so that the pieces concatenated are the text the tokens decode to.

A token decoded alone is not its piece of the text: a character split across tokens (an emoji,
a CJK character in a byte-level vocabulary) decodes to U+FFFD in each, and a SentencePiece token
loses its leading space at the start of a decode. Here each token is decoded after a few tokens
before it (as vLLM's incremental detokenizer does): a token that ends inside a character gets
the empty piece and the token that completes the character gets all of it. So ``text``,
``tokens``, ``token_logprobs`` and ``text_offset`` of ``/v1/completions`` describe one token
sequence, one entry per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: tokens decoded before each one: enough for a character of up to 4 bytes split into single bytes
LOOKBACK = 6

_INCOMPLETE = "\ufffd"


@dataclass(frozen=True)
class Pieces:
    """The pieces of a token sequence, and the names of alternative tokens at each position."""

    pieces: list[str]
    names: list[dict[int, str]]  # per position: a token id's piece had it been chosen there

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def offsets(self, start: int = 0) -> list[int]:
        """Where each piece starts in :attr:`text` (plus ``start``)."""
        out, at = [], start
        for piece in self.pieces:
            out.append(at)
            at += len(piece)
        return out


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=True)) if ids else ""


def token_pieces(tokenizer: Any, ids: Sequence[int], alternatives: Sequence[Sequence[int]] = ()) -> Pieces:
    """The piece of ``ids`` each token adds to their text (special tokens add nothing), and, for
    position ``i`` of ``alternatives``, what each of its token ids would have added there."""
    pieces: list[str] = []
    names: list[dict[int, str]] = []
    pending = 0  # the first token whose piece is not out yet (it ends inside a character)
    for i in range(len(ids)):
        low = max(0, pending - LOOKBACK)
        before = _decode(tokenizer, ids[low:pending])
        now = _decode(tokenizer, ids[low : i + 1])
        if i < len(alternatives):
            names.append({t: _piece(before, _decode(tokenizer, [*ids[low:i], t])) for t in alternatives[i]})
        if now.endswith(_INCOMPLETE) and i + 1 < len(ids) and _completes_later(tokenizer, ids, low, i):
            pieces.append("")
            continue
        pieces.append(_piece(before, now))
        pending = i + 1
    return Pieces(pieces, names)


def _piece(before: str, now: str) -> str:
    """What ``now`` adds to ``before`` (the common prefix is dropped when a decode rewrote it)."""
    if now.startswith(before):
        return now[len(before) :]
    common = 0
    while common < min(len(before), len(now)) and before[common] == now[common]:
        common += 1
    return now[common:]


def _completes_later(tokenizer: Any, ids: Sequence[int], low: int, i: int) -> bool:
    """Whether the U+FFFD ending the decode up to token ``i`` is a character the next tokens
    complete (rather than a U+FFFD of the text itself, or bytes that never form a character)."""
    now = _decode(tokenizer, ids[low : i + 1])
    ahead = _decode(tokenizer, ids[low : min(len(ids), i + 1 + 3)])
    return not ahead.startswith(now)
