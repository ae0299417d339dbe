"""The PagedStore suite on the reference store built with ``fused_decode=False``: decode groups
attend through padded gathers, the path PST-013's padding test is about (the suite itself runs
the backend's own store, which on the CPU reads each context where it lies, PST-008)."""

from __future__ import annotations

import pytest

from pagedkv.interfaces import PagedStore, StoreConfig
from pagedkv.store.paged_store import TorchPagedStore
from pagedkv_conformance.loading import STORE_DEFAULTS, MakePagedStore
from pagedkv_conformance.suite_paged_store import PagedStoreSuite


class TestGatheredStore(PagedStoreSuite):
    """specs/paged-store.md on the gathered decode path."""

    @pytest.fixture
    def make_paged_store(self) -> MakePagedStore:
        def make(**fields: object) -> PagedStore:
            config = StoreConfig(**{**STORE_DEFAULTS, **fields})  # type: ignore[arg-type]
            store = TorchPagedStore(config, fused_decode=False)
            assert not store.fused_decode
            return store

        return make

    @pytest.fixture
    def backend_capabilities(self) -> frozenset[str]:
        return frozenset({"paged_store"})
