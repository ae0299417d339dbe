"""Collects the engine suite of stop strings completed together against the configured
backend."""

from __future__ import annotations

from .suite_engine_stop_strings import EngineStopStringSuite


class TestEngineStopStrings(EngineStopStringSuite):
    """ENG-144 and ENG-145 against ``--backend``."""
