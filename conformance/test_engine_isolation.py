"""Collects the engine failure-isolation suite against the configured backend."""

from __future__ import annotations

from .suite_engine_isolation import EngineIsolationSuite


class TestEngineIsolation(EngineIsolationSuite):
    """specs/engine.md ENG-070..073 against ``--backend``."""
