"""Keeping the server's start-up heap out of the garbage collector's scans (SRV-140).

CPython's cyclic collector scans every object it tracks in the generation it collects; a full
(oldest generation) collection scans them all. A server's start-up leaves a large heap that
lives as long as the process: the model's modules and parameters, the tokenizer, every module
imported. While the server runs, its requests' allocations set off full collections now and
then, and each one scanned that whole heap holding the interpreter's lock: the engine thread
could not step meanwhile, so every stream paused (hundreds of milliseconds with a
Qwen3-0.6B-shaped model). ``gc.freeze`` moves every tracked object to a permanent generation that
no collection scans; collecting first keeps the start-up's own garbage from being frozen, where
it would never be freed. vLLM's API server and engine core do the same.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect the garbage made so far, then move every object still tracked out of the
    collector's generations. Call it once the process has built what it keeps (the engine, the
    app) and before it serves. A process-wide setting: later collections scan only what was
    allocated after it.

    Returns:
        how many objects are frozen now (``gc.get_freeze_count()``).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
