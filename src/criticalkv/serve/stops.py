"""An answer's text as it grows, ending before the first stop sequence.

Streamed pieces hold back what may still change: trailing whitespace (the final answer is
stripped) and a tail that may be the start of a stop sequence, so that a stop sequence never
reaches the client and the pieces concatenated are the non-streamed answer.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """The pieces of a growing text safe to send, up to the first of ``stops`` (none: all of it).

    :meth:`update` takes the whole text so far each time (each a prefix of the next, except
    where a tokenizer rewrites earlier characters: that update sends nothing and the next one
    that extends what was sent catches up); :attr:`emitted` is the answer so far.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop sequences must be non-empty")
        self.stops = tuple(stops)
        self.emitted = ""
        self.stopped = False  # a stop sequence occurred: the answer has ended

    def update(self, text: str, final: bool = False) -> str:
        """The new piece of ``text`` to send; ``final``: the text is complete (the rest is sent,
        stripped of trailing whitespace, unless a stop sequence ends it earlier)."""
        if self.stopped or not text.startswith(self.emitted):
            return ""
        start = len(self.emitted)
        # an occurrence cannot start before ``start``: its beginning would have been held back
        found = [at for stop in self.stops if (at := text.find(stop, start)) >= 0]
        pending = [] if final else self._partial_starts(text, start)
        if found and not any(at < min(found) for at in pending):
            end, self.stopped = min(found), True
        elif found:  # a longer stop that would start earlier may still complete
            end = min(pending)
        elif final:
            end = len(text.rstrip())
        else:  # hold back trailing whitespace and a tail that may begin a stop
            end = min([max(len(text.rstrip()), start), *pending])
        piece = text[start:end]
        self.emitted += piece
        return piece

    def _partial_starts(self, text: str, start: int) -> list[int]:
        """Where a stop sequence may begin whose start ends ``text`` (not yet complete)."""
        starts = []
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text) - start), 0, -1):
                if text.endswith(stop[:k]):
                    starts.append(len(text) - k)
                    break
        return starts
