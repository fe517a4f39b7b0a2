"""Decode storage of a compressed layer: segments of equal length grouped into dense buffers.

A layer's (batch row, KV head) segments, sorted by kept length as in :mod:`criticalkv.cache.layouts.tiers`,
fall into *buckets* of equal length (consecutive in the sorted order). Bucket ``b`` holds its
``n_b`` segments' prefix and tail in one ``(n_b, L_b + capacity, d)`` buffer, so decoding the layer
is one ``scaled_dot_product_attention`` call per bucket; each segment lies wholly in one bucket, so
the buckets' outputs are exact as they are and only need concatenating. A uniform layer is one
bucket: a single sdpa call, as fast per entry as the uncompressed model.

Every bucket is a view into one flat ``(rows, d)`` tensor per keys/values, so an append is a
single ``index_copy_`` over all segments. Bytes: ``sum_s L_s + S * capacity`` entries, the same
as the tiers plus the tail they replace (nothing is stored twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from criticalkv.cache.layouts.tiers import RaggedPrefix, Tier


@dataclass(frozen=True)
class Bucket:
    """Sorted segments ``[start, start + keys.shape[0])``, each with ``length`` prefix entries."""

    start: int
    length: int
    keys: torch.Tensor  # (n, length + capacity, d), a view into the flat storage
    values: torch.Tensor


class LengthBuckets:
    """Prefix and tail of every segment of one layer, one dense buffer per kept length.

    Build with :meth:`build`; ``capacity`` is the tail room per segment. :meth:`attend` and
    :meth:`write` take and give the original segment order (``b * H_kv + h``): a bucket whose
    segments are consecutive there reads its queries as a slice and its output is concatenated
    in place, so a decode step gathers nothing (an index tensor per bucket otherwise).
    """

    def __init__(self, prefix: RaggedPrefix, capacity: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
        sorted_lengths = prefix.lengths[prefix.perm].tolist()
        self.capacity = capacity
        self.num_segments = len(sorted_lengths)
        rows = sum(sorted_lengths) + self.num_segments * capacity
        self.flat_keys = torch.empty(rows, d, dtype=dtype, device=device)
        self.flat_values = torch.empty_like(self.flat_keys)
        self.buckets: list[Bucket] = []
        base = torch.empty(self.num_segments, dtype=torch.long)  # sorted order: row of the first tail slot
        start = offset = 0
        while start < self.num_segments:
            length = sorted_lengths[start]
            end = start
            while end < self.num_segments and sorted_lengths[end] == length:
                end += 1
            n, width = end - start, length + capacity
            keys = self.flat_keys[offset : offset + n * width].view(n, width, d)
            values = self.flat_values[offset : offset + n * width].view(n, width, d)
            self.buckets.append(Bucket(start, length, keys, values))
            base[start:end] = offset + length + width * torch.arange(n)
            start, offset = end, offset + n * width
        #: the buckets as (1, n, L + capacity, d), made once (each decode step only slices them)
        self._views = [(b.keys[None], b.values[None]) for b in self.buckets]
        #: per bucket, its segments in the original order: a slice where consecutive, else an index
        self._rows: list[slice | torch.Tensor] = []
        for b in self.buckets:
            segments = prefix.perm[b.start : b.start + b.keys.shape[0]]
            first, n = int(segments[0]), int(segments.shape[0])
            consecutive = bool(torch.equal(segments, torch.arange(first, first + n, device=segments.device)))
            self._rows.append(slice(first, first + n) if consecutive else segments.to(device))
        slices = [r for r in self._rows if isinstance(r, slice)]
        #: the buckets in original order when all are slices: the output is their concatenation
        self._order = None
        if len(slices) == len(self._rows):
            self._order = sorted(range(len(slices)), key=lambda i: slices[i].start)
        base = base.to(device)
        #: per segment in the original order, the flat row of its tail entry 0
        self.tail_base = base if prefix.identity else base[prefix.inv_perm]

    @classmethod
    def build(
        cls,
        prefix: RaggedPrefix,
        tail_keys: torch.Tensor | None,
        tail_values: torch.Tensor | None,
        tail_len: int,
        capacity: int,
        like: torch.Tensor,
    ) -> LengthBuckets:
        """Move ``prefix``'s tiers and the (S, >= tail_len, d) sorted tail into buckets of the
        head size, dtype and device of ``like``."""
        if capacity < tail_len:
            raise ValueError(f"a tail capacity of {capacity} cannot hold the {tail_len} entries already appended")
        out = cls(prefix, capacity, int(like.shape[-1]), like.dtype, like.device)
        for bucket in out.buckets:
            rows = slice(bucket.start, bucket.start + bucket.keys.shape[0])
            offset = 0
            for tier in prefix.tiers:
                width = int(tier.keys.shape[1])
                if offset >= bucket.length:
                    break
                bucket.keys[:, offset : offset + width] = tier.keys[rows]
                bucket.values[:, offset : offset + width] = tier.values[rows]
                offset += width
            if tail_len and tail_keys is not None and tail_values is not None:
                end = bucket.length + tail_len
                bucket.keys[:, bucket.length : end] = tail_keys[rows, :tail_len]
                bucket.values[:, bucket.length : end] = tail_values[rows, :tail_len]
        return out

    @property
    def single(self) -> bool:
        """One bucket: every segment keeps the same count (tiers and tail can be views)."""
        return len(self.buckets) == 1

    def grown(self, prefix: RaggedPrefix, tail_len: int, capacity: int) -> LengthBuckets:
        """A copy with room for ``capacity`` tail entries per segment (contents kept)."""
        out = LengthBuckets(prefix, capacity, self.flat_keys.shape[-1], self.flat_keys.dtype, self.flat_keys.device)
        keep = [(b.length + tail_len) for b in self.buckets]
        for old, new, width in zip(self.buckets, out.buckets, keep, strict=True):
            new.keys[:, :width], new.values[:, :width] = old.keys[:, :width], old.values[:, :width]
        return out

    def write(self, keys: torch.Tensor, values: torch.Tensor, tail_len: int) -> None:
        """Store (S, q, d) entries, original segment order, at tail slots ``[tail_len, tail_len + q)``."""
        s, q, d = keys.shape
        if tail_len + q > self.capacity:
            raise ValueError(f"{tail_len + q} tail entries do not fit a capacity of {self.capacity}; grow first")
        if q == 1:
            rows = self.tail_base + tail_len
        else:
            steps = torch.arange(tail_len, tail_len + q, device=keys.device)
            rows = (self.tail_base[:, None] + steps).reshape(-1)
        self.flat_keys.index_copy_(0, rows, keys.reshape(s * q, d))
        self.flat_values.index_copy_(0, rows, values.reshape(s * q, d))

    def attend(
        self, query: torch.Tensor, tail_mask: torch.Tensor | None, tail_len: int, scaling: float
    ) -> torch.Tensor:
        """(S, Q, d) queries (original segment order) over each segment's prefix and first
        ``tail_len`` tail entries, in the original order.

        ``tail_mask`` is (S, Q, tail_len) bool (True = attend), original order, or ``None``.
        """
        q = query[None]  # 4D: sdpa's fused CPU kernel takes (batch, heads, length, d) only
        outs = []
        for bucket, rows, (keys, values) in zip(self.buckets, self._rows, self._views, strict=True):
            n = int(bucket.keys.shape[0])
            total = bucket.length + tail_len
            mask = None
            if tail_mask is not None:
                cols = tail_mask[rows] if isinstance(rows, slice) else tail_mask.index_select(0, rows)
                prefix_cols = torch.ones(n, query.shape[1], bucket.length, dtype=torch.bool, device=query.device)
                mask = torch.cat([prefix_cols, cols], dim=-1)[None]
            q_b = q if self.single else (q[:, rows] if isinstance(rows, slice) else q.index_select(1, rows))
            out = F.scaled_dot_product_attention(
                q_b, keys[:, :, :total], values[:, :, :total], attn_mask=mask, scale=scaling
            )
            outs.append(out[0])
        if self.single:
            return outs[0]
        if self._order is not None:
            return torch.cat([outs[i] for i in self._order])
        result = query.new_empty(query.shape)
        for rows, out in zip(self._rows, outs, strict=True):
            if isinstance(rows, slice):
                result[rows] = out
            else:
                result.index_copy_(0, rows, out)
        return result

    def tiers(self) -> list[Tier]:
        """The prefix as staircase tiers (:func:`criticalkv.cache.layouts.tiers.build_prefix`'s layout):
        views for a single bucket, copies otherwise."""
        if self.single:
            bucket = self.buckets[0]
            return [Tier(bucket.keys[:, : bucket.length], bucket.values[:, : bucket.length])] if bucket.length else []
        levels = sorted({b.length for b in self.buckets if b.length > 0})
        tiers, previous = [], 0
        for level in levels:
            parts = [b for b in self.buckets if b.length >= level]  # the longest buckets come first
            keys = torch.cat([b.keys[:, previous:level] for b in parts])
            values = torch.cat([b.values[:, previous:level] for b in parts])
            tiers.append(Tier(keys, values))
            previous = level
        return tiers

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, capacity, d) sorted tail keys and values: views for a single bucket, copies otherwise."""
        if self.single:
            bucket = self.buckets[0]
            return bucket.keys[:, bucket.length :], bucket.values[:, bucket.length :]
        keys = torch.cat([b.keys[:, b.length :] for b in self.buckets])
        return keys, torch.cat([b.values[:, b.length :] for b in self.buckets])

    def nbytes(self) -> int:
        return 2 * self.flat_keys.numel() * self.flat_keys.element_size()
