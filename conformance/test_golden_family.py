"""Collects the family golden suite (Qwen3-MoE, scaled RoPE) against the configured backend."""

from __future__ import annotations

from .suite_golden_family import GoldenFamilySuite


class TestGoldenFamily(GoldenFamilySuite):
    """specs/golden.md GLD-050.. against ``--backend``."""
