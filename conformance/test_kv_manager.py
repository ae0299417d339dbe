"""The example-based KVManager suite, run against the backend under test (``--backend``)."""

from __future__ import annotations

from .suite_kv_manager import KVManagerSuite


class TestKVManager(KVManagerSuite):
    """Every test of :class:`KVManagerSuite`, with the plugin's ``make_kv_manager``."""
