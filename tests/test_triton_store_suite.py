"""The PagedStore suite (specs/paged-store.md) on the Triton store: the reference store's pools
written by the store kernel and attended by the decode and varlen kernels, run by Triton's
interpreter on the CPU (PST-047)."""

from __future__ import annotations

import pytest

from pagedkv.accel.cuda.triton_store import TritonPagedStore
from pagedkv.interfaces import PagedStore, StoreConfig
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv_conformance.loading import STORE_DEFAULTS, MakePagedStore
from pagedkv_conformance.suite_paged_store import PagedStoreSuite


@pytest.mark.spec("PST-045", "PST-047")
class TestTritonStore(PagedStoreSuite):
    """specs/paged-store.md through the Triton kernels: each suite test kills, on this store,
    the broken kernel it kills on the reference (a leaked NaN tail, a causal mask off by one,
    a result that depends on page placement, state kept between batches, a host read in a
    layer's call)."""

    @pytest.fixture
    def make_paged_store(self) -> MakePagedStore:
        def make(**fields: object) -> PagedStore:
            config = StoreConfig(**{**STORE_DEFAULTS, **fields})  # type: ignore[arg-type]
            return TritonPagedStore(TorchPagedStore(config))

        return make

    @pytest.fixture
    def backend_capabilities(self) -> frozenset[str]:
        return frozenset({"paged_store"})
