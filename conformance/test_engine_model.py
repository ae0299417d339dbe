"""Collects the engine's real-model cases against the configured backend."""

from __future__ import annotations

from .suite_engine_model import EngineModelSuite


class TestEngineModel(EngineModelSuite):
    """Continuing chunks through real attention against ``--backend``."""
