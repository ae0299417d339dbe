"""Collects the engine observer suite against the configured backend."""

from __future__ import annotations

from .suite_engine_observers import EngineObserverSuite


class TestEngineObservers(EngineObserverSuite):
    """specs/engine.md ENG-051, ENG-052 against ``--backend``."""
