"""Timing with device synchronisation, and peak memory (host RSS, CUDA allocations)."""

from __future__ import annotations

import logging
import resource
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (CUDA); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """``time.perf_counter()`` after the device finished its queued work."""
    synchronize(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device) -> bool:
    """Reset the peak trackers; ``False`` if the host's peak RSS cannot be reset (non-Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        _CLEAR_REFS.write_text("5")  # Linux: resets VmHWM, the peak resident set size
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """Peak resident set size since the last reset (Linux), else since the process started."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def peak_device_bytes(device: torch.device) -> int | None:
    """Peak CUDA memory allocated since the last reset, ``None`` elsewhere."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None
