"""The token ids a compressed cache holds, as they went in (to recognise a continuation)."""

from __future__ import annotations

import torch


class TokenRecord:
    """The (B, n) token ids fed into a cache so far, or unknown.

    Unknown where a chunk came as embeddings or the cache was filled without a forward
    (:meth:`CompressedCache.from_states`, stacked caches): nothing is then compared.
    """

    def __init__(self, chunks: list[torch.Tensor] | None = None) -> None:
        self._chunks: list[torch.Tensor] | None = [] if chunks is None else chunks

    def clear(self) -> None:
        """A new prompt starts: nothing is held."""
        self._chunks = []

    def extend(self, ids: torch.Tensor | None) -> None:
        """Note ``ids`` (B, n) appended; ``None`` (embeddings) or another row count makes the record unknown."""
        if self._chunks is None:
            return
        if ids is None or ids.dim() != 2 or (self._chunks and self._chunks[0].shape[0] != ids.shape[0]):
            self._chunks = None
            return
        self._chunks.append(ids.detach().clone())

    @property
    def length(self) -> int | None:
        """Tokens recorded per row (``None`` when unknown)."""
        return None if self._chunks is None else sum(int(c.shape[1]) for c in self._chunks)

    def ids(self) -> torch.Tensor | None:
        """The recorded (B, n) ids, ``None`` when unknown or empty."""
        if not self._chunks:
            return None
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks, dim=1)]
        return self._chunks[0]

    def head(self, n: int) -> TokenRecord:
        """A record of the first ``n`` tokens (unknown if fewer were recorded)."""
        ids = self.ids()
        if ids is None or ids.shape[1] < n:
            return TokenRecord([] if n == 0 and self._chunks is not None else None)
        return TokenRecord([ids[:, :n]])

    def select(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (beam search, repeated rows), as the cache layers do."""
        ids = self.ids()
        if ids is not None:
            self._chunks = [ids[indices.to(ids.device).long()]]

    def repeat_rows(self, repeats: int) -> None:
        ids = self.ids()
        if ids is not None:
            self._chunks = [ids.repeat_interleave(repeats, dim=0)]
