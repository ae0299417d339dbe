"""Keeping the memory a step frees inside the process, so the next layer does not fault it in.

glibc gives a freed block back to the system when it was mmapped (blocks above
``M_MMAP_THRESHOLD``) or when the free top of the heap passes ``M_TRIM_THRESHOLD``; its
dynamic thresholds follow the largest block freed so far, but not the sum of a layer's
temporaries. A bfloat16 decode step of 32 sequences of about 150 positions (the Qwen3-0.6B
shape) frees 58 MB of K/V gathers and their float32 copies in every layer, which the next
layer faulted back in, page by page, at several times the cost of its attention
(``bench/kernels.md`` has the figures). vLLM's CPU backend preloads tcmalloc for the same
reason.

The thresholds are the process's: once raised, every allocation of the process keeps its
memory (transformers' included), and the resident size stays at its peak. Above the mmap
threshold a block is still mapped afresh each time: glibc 2.36 takes 1 GiB, and its manual
promises 32 MB.
"""

from __future__ import annotations

import ctypes
import platform

#: ``mallopt`` parameters (glibc's ``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Bytes of free heap top kept rather than given back to the system.
TRIM_THRESHOLD = 1 << 30
#: Blocks below this many bytes come from the heap, not from a fresh ``mmap``: a layer's
#: float32 copy of the K/V of 64 sequences of 300 positions is 80 MB.
MMAP_THRESHOLD = 1 << 30
#: The largest mmap threshold glibc's manual promises to take on 64-bit systems
#: (``4 * 1024 * 1024 * sizeof(long)``), set where it refuses :data:`MMAP_THRESHOLD`.
MMAP_THRESHOLD_MAX = 32 << 20


def can_retain_freed_memory() -> bool:
    """Whether this process's C library is glibc, whose ``mallopt`` sets the thresholds."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def retain_freed_memory() -> int:
    """Raise the process's trim and mmap thresholds (idempotent).

    Returns:
        The mmap threshold set, in bytes (:data:`MMAP_THRESHOLD`, or
        :data:`MMAP_THRESHOLD_MAX` where glibc refuses more); 0, changing nothing, where
        :func:`can_retain_freed_memory` is false or glibc refuses both thresholds.
    """
    if not can_retain_freed_memory():
        return 0
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return 0
    for threshold in (MMAP_THRESHOLD, MMAP_THRESHOLD_MAX):
        if mallopt(_M_MMAP_THRESHOLD, threshold) == 1:
            return threshold
    return 0
