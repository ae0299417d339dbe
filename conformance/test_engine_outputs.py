"""Collects the engine suite of completions against the configured backend."""

from __future__ import annotations

from .suite_engine_outputs import EngineOutputSuite


class TestEngineOutputs(EngineOutputSuite):
    """ENG-142 against ``--backend``."""
