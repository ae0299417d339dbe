"""Collects the engine suite of sampling parameters at their edges against the configured
backend."""

from __future__ import annotations

from .suite_engine_param_edges import EngineParamsEdgeSuite


class TestEngineParamsEdges(EngineParamsEdgeSuite):
    """ENG-141 and ENG-120 against ``--backend``."""
