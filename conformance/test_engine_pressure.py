"""Collects the engine suite of parallel samples under memory pressure against the configured
backend."""

from __future__ import annotations

from .suite_engine_pressure import EnginePressureSuite


class TestEnginePressure(EnginePressureSuite):
    """ENG-130 against ``--backend``."""
