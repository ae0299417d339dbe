"""Resolves the runner's ``attention`` option (ENG-199): the store a v1 runner writes and
attends its K/V through.

``"reference"`` keeps the store given. ``"triton"`` puts the Triton kernels in its place: a
:class:`~pagedkv.accel.cuda.triton_store.TritonPagedStore` over the same pools, the store
given left as it is (another runner may hold it). Triton is imported here, and only here, when
it is asked for: a process that never asks needs no triton.
"""

from __future__ import annotations

import importlib.util

from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PagedStore
from pagedkv.store.paged_store import TorchPagedStore


def attention_store(store: PagedStore, options: RunnerOptions) -> PagedStore:
    """The store a v1 runner with ``options`` uses in place of ``store``.

    Raises:
        InvalidRequest: ``attention="triton"`` where it cannot run: with ``compile`` or
            ``cuda_graphs`` (whose fixed-shape steps capture the reference attention), over a
            store other than pagedkv's reference one, without triton installed, or on a pool
            neither on a CUDA device nor on the CPU under Triton's interpreter.
    """
    if options.attention == "reference":
        return store
    prefix = f"attention={options.attention!r}"
    if options.compile or options.cuda_graphs:
        raise InvalidRequest(
            f"{prefix} runs eager steps; compile and cuda_graphs capture the reference attention"
        )
    if not isinstance(store, TorchPagedStore):
        raise InvalidRequest(f"{prefix} reads the pools of pagedkv's TorchPagedStore")
    if importlib.util.find_spec("triton") is None:
        raise InvalidRequest(f"{prefix}: triton is not installed (pip install triton)")
    device = store.config.device.split(":")[0]
    # Imported only now: importing the kernels imports triton, and defines them for its
    # interpreter or for a GPU once and for all.
    from pagedkv.accel.cuda.store_kernel import runs_interpreted
    from pagedkv.accel.cuda.triton_store import TritonPagedStore

    if device == "cpu" and not runs_interpreted():
        raise InvalidRequest(
            f"{prefix} on a CPU pool runs only under Triton's interpreter "
            "(TRITON_INTERPRET=1 set before the kernels are first imported)"
        )
    if device not in ("cpu", "cuda"):
        raise InvalidRequest(f"{prefix} runs on a CUDA device, not on {device}")
    return TritonPagedStore(store)
