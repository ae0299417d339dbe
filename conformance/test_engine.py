"""Collects the engine conformance suite against the configured backend."""

from __future__ import annotations

from .suite_engine import EngineSuite


class TestEngine(EngineSuite):
    """specs/engine.md against ``--backend``."""
