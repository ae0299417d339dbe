"""Resolves the runner's ``attention`` option (ENG-199): the store a v1 runner writes and
attends its K/V through, and the fixed-shape decode path over that store (ENG-228).

``"reference"`` keeps the store given. ``"triton"`` puts the Triton kernels in its place: a
:class:`~pagedkv.accel.cuda.triton_store.TritonPagedStore` over the same pools, the store
given left as it is (another runner may hold it); its fixed-shape decode steps read the pages in
place and are captured per batch size at start, where the reference store's gather each context
and are captured per batch size and width on first use. Triton is imported here, and only here,
when it is asked for: a process that never asks needs no triton.
"""

from __future__ import annotations

import importlib.util

from pagedkv.accel.static_decode import STATIC_MAX_BATCH, StaticDecodePath, static_decode_over
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import PagedStore
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.store.paged_store import TorchPagedStore


def attention_store(store: PagedStore, options: RunnerOptions) -> PagedStore:
    """The store a v1 runner with ``options`` uses in place of ``store``.

    Raises:
        InvalidRequest: ``attention="triton"`` where it cannot run: with ``compile`` (whose
            fixed-shape steps compile the reference attention), over a
            store other than pagedkv's reference one, without triton installed, or on a pool
            neither on a CUDA device nor on the CPU under Triton's interpreter.
    """
    if options.attention == "reference":
        return store
    prefix = f"attention={options.attention!r}"
    if options.compile:
        raise InvalidRequest(
            f"{prefix} runs eager or captured steps; compile compiles the reference attention"
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


def static_decode_for(
    model: Qwen3ForCausalLM, store: PagedStore, options: RunnerOptions
) -> StaticDecodePath:
    """The fixed-shape decode path of ``options`` for ``model`` (the runner's own copy) over
    ``store`` (what :func:`attention_store` gave): the Triton one over the Triton store, the
    reference one over the reference store.

    Precondition: ``options`` ask for fixed shapes where they can run
    (:func:`~pagedkv.accel.static_decode.static_store` has checked them).

    Raises:
        InvalidRequest: a store that is neither.
    """
    if isinstance(store, TorchPagedStore):
        return static_decode_over(model, store, options)
    # Imported only now: the Triton store is in use, so triton is imported already.
    from pagedkv.accel.cuda.triton_static_decode import TritonStaticDecode
    from pagedkv.accel.cuda.triton_store import TritonPagedStore

    if not isinstance(store, TritonPagedStore):
        raise InvalidRequest(f"no fixed-shape decode path reads a {type(store).__name__}")
    config = store.config
    return TritonStaticDecode(
        model,
        store,
        max_batch=options.max_decode_batch or STATIC_MAX_BATCH,  # ENG-226
        max_width=min(model.config.max_positions, config.num_pages * config.page_size),
        cuda_graphs=options.cuda_graphs is True,
    )
