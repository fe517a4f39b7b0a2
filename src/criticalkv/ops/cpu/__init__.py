"""The CPU implementation of ``torch.ops.criticalkv.ragged_decode``: a C kernel (:mod:`.kernel`),
compiled once per machine by :mod:`.build` into a cache that loads only what it built (:mod:`.trust`),
called through one checked argument struct (:mod:`.args`). Importing this package registers it."""

from criticalkv.ops.cpu.build import KERNEL_ENV, KERNEL_MODES, KernelUnavailable, decode_kernel, kernel_mode
from criticalkv.ops.cpu.kernel import c_ragged_decode, ragged_decode_cpu, register

register()

__all__ = [
    "KERNEL_ENV",
    "KERNEL_MODES",
    "KernelUnavailable",
    "c_ragged_decode",
    "decode_kernel",
    "kernel_mode",
    "ragged_decode_cpu",
]
