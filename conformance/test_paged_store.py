"""Collects the PagedStore conformance suite against the configured backend."""

from __future__ import annotations

from .suite_paged_store import PagedStoreSuite


class TestPagedStore(PagedStoreSuite):
    """specs/paged-store.md against ``--backend``."""
