"""Collects the golden suite against the configured backend."""

from __future__ import annotations

from .suite_golden import GoldenSuite


class TestGolden(GoldenSuite):
    """specs/golden.md GLD-020.. against ``--backend``."""
