"""Collects the prompt-dict salt engine suite against the configured backend."""

from __future__ import annotations

from .suite_engine_salt import EngineSaltSuite
from .suite_engine_text import tokenizer

__all__ = ["TestEngineSalt", "tokenizer"]


class TestEngineSalt(EngineSaltSuite):
    """ENG-062's salted prompt dicts against ``--backend``."""
