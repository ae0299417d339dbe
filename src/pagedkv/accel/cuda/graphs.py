"""CUDA graph capture shared by the fixed-shape decode paths (ENG-206, ENG-228).

Every graph of one runner is captured into one memory pool: replays never overlap (they run on
one stream) and each step copies its output into buffers allocated outside the pool, so the
graphs may share their temporaries.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture_pool() -> object:
    """A new memory pool for CUDA graph captures (``torch.cuda.graph_pool_handle``)."""
    return torch.cuda.graph_pool_handle()


def captured(step: Callable[[], None], device: torch.device, pool: object) -> Callable[[], None]:
    """``step`` captured as a CUDA graph (after warm-up runs on a side stream) into the memory
    pool ``pool``, which other captures of the same runner share: replaying it reruns its
    kernels on the buffers it captured.

    Precondition: the buffers hold a plan whose K/V the warm-up runs may write (the plan about
    to run, or one that writes nothing).
    """
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: lazy initialisation outside the capture
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):  # type: ignore[arg-type]
        step()
    return graph.replay
