"""Collects the engine suite of admission's KVManager calls against the configured backend."""

from __future__ import annotations

from .suite_engine_admission import EngineAdmissionSuite


class TestEngineAdmission(EngineAdmissionSuite):
    """ENG-027 and ENG-175 against ``--backend``."""
