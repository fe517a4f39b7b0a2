"""What this machine computes in hardware, read from torch's own probes (a low module: the core's
scores and the model loader both ask it)."""

from __future__ import annotations

import torch


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX512_BF16 or AMX), where torch's bf16
    matmuls beat float32; elsewhere (AVX2, AVX-512 without bf16) they are emulated and slower.

    Measured for the default model in docs/performance.md ("bfloat16 on the CPU"): a 4K prefill
    2.3-2.6x faster than float32 with AMX, 2-4x slower on an AVX2-only CPU, at the same fidelity.
    """
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own probes
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)
