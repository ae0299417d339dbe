"""The reference backend: what ``make conformance`` tests when no ``BACKEND`` is given.

A backend is any object satisfying :class:`pagedkv.interfaces.Backend`, returned by a
zero-argument factory named ``module:factory`` (``--backend`` / ``PAGEDKV_BACKEND``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.interfaces import KVManager, KVManagerConfig
from pagedkv.kv.manager import ReferenceKVManager


@dataclass(frozen=True)
class ReferenceBackend:
    """pagedkv's own implementations."""

    name: str = "pagedkv reference"
    capabilities: frozenset[str] = frozenset({"prefix_caching", "eviction", "reset"})

    def create_kv_manager(self, config: KVManagerConfig) -> KVManager:
        return ReferenceKVManager(config)


def reference_backend() -> ReferenceBackend:
    """Factory for ``--backend pagedkv.backend:reference_backend``."""
    return ReferenceBackend()
