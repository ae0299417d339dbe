"""The fork suite (KVM-037..039), run against the backend under test (``--backend``)."""

from __future__ import annotations

from .suite_kv_fork import KVForkSuite


class TestKVFork(KVForkSuite):
    """Every test of :class:`KVForkSuite`, with the plugin's ``make_kv_manager``."""
