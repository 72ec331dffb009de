"""Keep freed host memory in the process, so a training step's large tensors stop page-faulting.

glibc serves an allocation above its mmap threshold (32 MiB at most, by default) with a fresh
mmap and returns it to the system on free. A CPU training step makes such tensors every chunk
([448, 49152] float32 is 88 MB), and each one is faulted in page by page again: on the 2-core VM
a random [448, 49152] tensor, a product of it, its bf16 copy and a [49152, 256] zeros took 250 ms
with 66k page faults each time, and 110 ms with none once freed blocks were kept. Raising the
mmap and trim thresholds keeps freed blocks in the heap for the next step; the process's RSS then
stays at its high-water mark, which is what peak-memory figures measure anyway.
Part of train.fast_kernels; `make bench-train` measures it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP = 2**31 - 1  # mallopt takes an int: ~2 GiB, larger than any single tensor of a step

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process. True when they are in force;
    False where the C library is not glibc (musl, macOS), where nothing is changed."""
    global _applied
    if _applied is None:
        _applied = False
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        _applied = bool(mallopt(_M_MMAP_THRESHOLD, _KEEP)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP))
    return _applied
