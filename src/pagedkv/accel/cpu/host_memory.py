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

What is retained is given back by :func:`release_freed_memory` (glibc's ``malloc_trim``):
every whole free page of every arena, not only the heap's top. A server calls it once it has
been idle for a moment (SRV-137), so an idle process holds the memory its live objects use and
not the peak of the busiest step it ever ran, nor the fragments left between live blocks by
steps of many shapes: under the soak's mix of 600 requests the heap's free space grew 3 MB at a
time as new fragments appeared, and a release gave back about 47 MB of it.

glibc's trim gives back the free top of the main arena only: the free top of an arena of
another thread (glibc makes up to eight per core, one per thread while they contend) stays
resident up to the trim threshold, and it followed where that thread's last step left its
blocks: 3 MB up or down from one idle moment to the next. :func:`use_one_arena`, called before
the process starts its threads, makes them all allocate from the main arena, so a release
reaches all of it. A Python server's threads take turns at the interpreter's lock anyway, and
torch allocates a product's output before its worker threads run.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

#: ``mallopt`` parameters (glibc's ``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: Where an operator sets glibc's arena count at the process's start; :func:`use_one_arena`
#: keeps what they set.
ARENA_VARIABLE = "MALLOC_ARENA_MAX"
ARENA_TUNABLE = "glibc.malloc.arena_max"
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


def _mallopt(parameter: int, value: int) -> bool:
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(parameter, value) == 1)


def use_one_arena(environ: Mapping[str, str] | None = None) -> bool:
    """Make every thread that has not allocated yet allocate from glibc's main arena
    (``M_ARENA_MAX`` 1), unless the process was started with an arena count of the
    operator's (``MALLOC_ARENA_MAX``, or ``glibc.malloc.arena_max`` in ``GLIBC_TUNABLES``),
    which is kept. Threads that allocated before keep the arena they have: call it first.

    Args:
        environ: the environment the process was started with (default: ``os.environ``).

    Returns:
        Whether the count was set; ``False``, changing nothing, where the operator set one or
        :func:`can_retain_freed_memory` is false.
    """
    env = os.environ if environ is None else environ
    if ARENA_VARIABLE in env or ARENA_TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return False
    return can_retain_freed_memory() and _mallopt(_M_ARENA_MAX, 1)


def retain_freed_memory() -> int:
    """Raise the process's trim and mmap thresholds (idempotent).

    Returns:
        The mmap threshold set, in bytes (:data:`MMAP_THRESHOLD`, or
        :data:`MMAP_THRESHOLD_MAX` where glibc refuses more); 0, changing nothing, where
        :func:`can_retain_freed_memory` is false or glibc refuses both thresholds.
    """
    if not can_retain_freed_memory():
        return 0
    if not _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return 0
    for threshold in (MMAP_THRESHOLD, MMAP_THRESHOLD_MAX):
        if _mallopt(_M_MMAP_THRESHOLD, threshold):
            return threshold
    return 0


def release_freed_memory() -> bool:
    """Give every whole free page of the process's ``malloc`` arenas back to the system
    (glibc's ``malloc_trim(0)``), whatever the thresholds; live blocks are untouched.

    It walks every arena's free blocks, holding each arena's lock while it does: about 10 ms
    after 250 MB of blocks of 4 to 300 KB were freed here, under 1 ms when little was, so it
    belongs where nothing waits on it (an idle server), not between steps. The pages given
    back are faulted in again when next used.

    Returns:
        Whether memory was given back; ``False``, changing nothing, where
        :func:`can_retain_freed_memory` is false.
    """
    if not can_retain_freed_memory():
        return False
    malloc_trim = ctypes.CDLL(None).malloc_trim
    malloc_trim.argtypes = (ctypes.c_size_t,)
    malloc_trim.restype = ctypes.c_int
    return bool(malloc_trim(0))
