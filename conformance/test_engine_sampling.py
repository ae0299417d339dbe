"""Collects the sampling-controls engine suite against the configured backend."""

from __future__ import annotations

from .suite_engine_sampling import EngineSamplingSuite


class TestEngineSampling(EngineSamplingSuite):
    """ENG-048 against ``--backend``."""
