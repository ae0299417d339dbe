"""Bounding oneDNN's caches of products built for one shape, so memory does not grow with shapes.

oneDNN builds a primitive (JIT-compiled kernels and their scratch buffers) for each shape of a
product it runs, and keeps it in two least-recently-used caches: its own primitive cache
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's, through which torch calls it
(``LRU_CACHE_CAPACITY``); both hold 1024 primitives by default. A prefill of ``n`` tokens
runs each distinct linear shape with ``n`` rows, so every new prompt length added about 2 MB
to the embedded model's process (0.6 MB per primitive of a 256 x 1536 product of 100 to
300 rows): a server that had seen prompt lengths 1 to 600 held 1 GB more than one that had
seen one. Capped, a shape evicted is built again when it comes back (the same primitive, so
the same results to the bit), and the memory primitives hold is at most the capacity times
the largest one, whatever the prompts seen.

Both variables are read by oneDNN and ideep once, at their first primitive of the process: a
setting of the whole process, applied before the first product (the runner's, when it packs
its weights). A value the process was started with is the operator's and is kept.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

#: Primitives each cache holds: a steady load's shapes (a decode batch size above the packed
#: GEMV's rows, times a model's four or five distinct linear shapes, and a prefill chunk's) stay
#: built; others are rebuilt when they come back, which cost no time measurable against the
#: product itself here. With 128, the server's memory under a mix of 600 requests per round
#: still grew 35 MB from round 3 to round 6 as the cache filled with primitives of larger
#: steps; with 32 it grew 3 MB (SRV-106).
PRIMITIVE_CACHE_CAPACITY = 32

#: oneDNN's primitive cache, then ideep's cache of the primitives torch runs.
CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


@dataclass(frozen=True, slots=True)
class CacheCapacities:
    """The capacity each cache of :data:`CAPACITY_VARIABLES` takes (variable -> value), and
    which of them the process was started with (kept as the operator set them)."""

    values: dict[str, str]
    kept: frozenset[str]


def cap_primitive_caches(
    capacity: int = PRIMITIVE_CACHE_CAPACITY, environ: MutableMapping[str, str] | None = None
) -> CacheCapacities:
    """Set each variable of :data:`CAPACITY_VARIABLES` not already set to ``capacity``
    primitives (idempotent).

    Args:
        capacity: primitives per cache, at least 1 (ideep's cache needs one).
        environ: the environment to set (default: the process's, ``os.environ``, which is also
            the C library's that oneDNN reads).

    Raises:
        ValueError: ``capacity`` below 1.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1 primitive, not {capacity}")
    env = os.environ if environ is None else environ
    kept = frozenset(name for name in CAPACITY_VARIABLES if name in env)
    for name in CAPACITY_VARIABLES:
        env.setdefault(name, str(capacity))
    return CacheCapacities({name: env[name] for name in CAPACITY_VARIABLES}, kept)
