"""Collects the parallel-sampling engine suite against the configured backend."""

from __future__ import annotations

from .suite_engine_parallel import EngineParallelSuite


class TestEngineParallel(EngineParallelSuite):
    """ENG-047 against ``--backend``."""
