"""A step's plan staged to a CUDA device: pinned, copied without blocking, and prepared by the
Triton and reference stores, its page copies made, without one synchronising call (ENG-227).
Needs a GPU: the CPU tests of the same path are tests/test_plan_staging.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pagedkv.accel.cuda.staging import PlanStaging
from pagedkv.interfaces import PageCopy, StoreConfig
from pagedkv.plan import SeqChunk
from pagedkv.plan_builders import build_paged_plan
from pagedkv.store.paged_store import TorchPagedStore

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PAGE = 16
CHUNKS = [
    SeqChunk(tuple(range(40)), 7, (4, 9, 1)),
    SeqChunk((1,), 30, (2, 7)),
    SeqChunk((3, 3), 0, (11,), all_logits=True),
]


@contextmanager
def sync_errors() -> Iterator[None]:
    """Every synchronising CUDA call inside raises (``set_sync_debug_mode("error")``)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.spec("ENG-227")
def test_cuda_staging_is_pinned_and_moves_plans_without_synchronising() -> None:
    """The host buffer is pinned; building plans through it (after the first, which may
    allocate) makes no synchronising call, and their tensors equal the CPU plan's. Kills a
    pageable host buffer or a blocking copy (each synchronises), and a plan read back to check
    its ranges."""
    staging = PlanStaging("cuda")
    assert staging.host_buffer.is_pinned()
    assert staging.device_buffer.device.type == "cuda"
    build_paged_plan(CHUNKS, PAGE, "cuda", (), staging)  # warm: lazy CUDA initialisation
    with sync_errors():
        plans = [
            build_paged_plan(CHUNKS[: n + 1], PAGE, "cuda", [PageCopy(5, 6)], staging)
            for n in range(3)
        ]
    plan = plans[-1]
    wanted = build_paged_plan(CHUNKS, PAGE, "cpu", [PageCopy(5, 6)])
    assert plan.input_ids.device.type == "cuda"
    for got, want in (
        (plan.input_ids, wanted.input_ids),
        (plan.positions, wanted.positions),
        (plan.attention.page_tables, wanted.attention.page_tables),
        (plan.attention.slot_mapping, wanted.attention.slot_mapping),
        (plan.page_copies, wanted.page_copies),
    ):
        assert got is not None
        assert want is not None
        assert torch.equal(got.cpu(), want)


@needs_cuda
@pytest.mark.spec("ENG-227")
@pytest.mark.spec("PST-052")
def test_cuda_triton_prepare_does_not_synchronise() -> None:
    """The Triton store's ``prepare`` of a staged plan makes no synchronising call: its
    checks read the host copy and its metadata moves in one non-blocking copy from pinned
    memory. Kills a ``tolist``/``aminmax`` of a device tensor, or a pageable copy."""
    from pagedkv.accel.cuda.triton_store import TritonPagedStore

    store = TritonPagedStore(
        TorchPagedStore(StoreConfig(2, 2, 64, PAGE, 32, dtype="bfloat16", device="cuda"))
    )
    staging = PlanStaging("cuda")
    store.prepare(build_paged_plan(CHUNKS, PAGE, "cuda", (), staging).attention)  # warm
    with sync_errors():
        plan = build_paged_plan(CHUNKS, PAGE, "cuda", (), staging)
        metadata = store.prepare(plan.attention)
    assert metadata.page_tables.device.type == "cuda"
    assert metadata.page_tables.cpu().tolist() == [[4, 9, 1], [2, 7, 0], [11, 0, 0]]
    assert metadata.context_lens.cpu().tolist() == [47, 31, 2]


@needs_cuda
@pytest.mark.spec("ENG-227")
@pytest.mark.spec("PST-054")
@pytest.mark.spec("PST-055")
def test_cuda_reference_prepare_and_copy_pages_do_not_synchronise() -> None:
    """The reference store's ``prepare`` of a staged plan, and a fork step's ``copy_pages``
    from the plan's host copy, make no synchronising call, and the copy is made. Kills a group
    tensor moved from pageable memory by ``torch.tensor(..., device=...)``, and an
    ``aminmax``/``tolist`` of the device's page copies."""
    store = TorchPagedStore(StoreConfig(2, 2, 64, PAGE, 32, dtype="bfloat16", device="cuda"))
    staging = PlanStaging("cuda")
    copies = [PageCopy(5, 6)]
    warm = build_paged_plan(CHUNKS, PAGE, "cuda", copies, staging)  # lazy CUDA initialisation
    store.prepare(warm.attention)
    store.key_pool(0)[5] = 1.0
    torch.cuda.synchronize()
    with sync_errors():
        plan = build_paged_plan(CHUNKS, PAGE, "cuda", copies, staging)
        metadata = store.prepare(plan.attention)
        host = plan.page_copies_on_host
        assert host is not None
        store.copy_pages(host[0], host[1])
    assert host.device.type == "cpu"
    assert {g.kv_index.device.type for g in metadata.layout.groups} == {"cuda"}
    assert bool((store.key_pool(0)[6] == 1.0).all())
