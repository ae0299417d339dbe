"""The prefix-match suite (KVM-033..036), run against the backend under test (``--backend``)."""

from __future__ import annotations

from .suite_kv_match import KVMatchSuite


class TestKVMatch(KVMatchSuite):
    """Every test of :class:`KVMatchSuite`, with the plugin's ``make_kv_manager``."""
