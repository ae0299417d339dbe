"""Collects the engine's text cases against the configured backend."""

from __future__ import annotations

from .suite_engine_text import EngineTextSuite, tokenizer

__all__ = ["TestEngineText", "tokenizer"]


class TestEngineText(EngineTextSuite):
    """Text through ``--backend``'s engine."""
