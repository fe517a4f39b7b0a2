"""The KV bytes an lm-eval run's prompts held after compression, against the full cache's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from criticalkv.cache import CompressedCache


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class KVUsage:
    """Per prompt (a batch of B rows counts as B prompts with the batch's ratio),
    ``kv_bytes / kv_bytes_full`` just after compression, before any decoding; separately for the
    prompts compressed and those kept whole (too short for the budget to hold the window)."""

    compressed: list[float] = field(default_factory=list)
    whole: list[float] = field(default_factory=list)
    kv_bytes: int = 0
    kv_bytes_full: int = 0

    def add(self, cache: CompressedCache, rows: int, whole: bool = False) -> None:
        held, full = cache.kv_bytes(), cache.kv_bytes_full()
        self.kv_bytes += held
        self.kv_bytes_full += full
        (self.whole if whole else self.compressed).extend([held / full if full else 1.0] * rows)

    def summary(self, compressing: bool = True) -> dict[str, Any]:
        """What the results file records: the mean ratio over all prompts and over the compressed
        ones, the byte totals, the counts, and ``compressed_nothing``: a ``compressing`` method's
        run in which every prompt was kept whole (its numbers are the full cache's)."""
        prompts = len(self.compressed) + len(self.whole)
        return {
            "compressed_nothing": compressing and prompts > 0 and not self.compressed,
            "kv_ratio_mean": _mean(self.compressed + self.whole),
            "kv_ratio_mean_compressed": _mean(self.compressed),
            "kv_bytes": self.kv_bytes,
            "kv_bytes_full": self.kv_bytes_full,
            "prompts": len(self.compressed) + len(self.whole),
            "prompts_kept_whole": len(self.whole),
        }
