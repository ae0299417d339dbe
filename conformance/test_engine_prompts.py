"""Collects the engine suite of prompt forms against the configured backend."""

from __future__ import annotations

from .suite_engine_prompts import EnginePromptSuite


class TestEnginePrompts(EnginePromptSuite):
    """ENG-062 and ENG-152 against ``--backend``."""
