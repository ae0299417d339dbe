"""Collects the engine suite of sampling controls against the configured backend."""

from __future__ import annotations

from .suite_engine_controls import EngineControlSuite


class TestEngineControls(EngineControlSuite):
    """ENG-048 against ``--backend``."""
