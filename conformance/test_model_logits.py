"""Collects the model runner logits suite against the configured backend."""

from __future__ import annotations

from .suite_model_logits import ModelLogitsSuite


class TestModelLogits(ModelLogitsSuite):
    """GLD-010..012 against ``--backend``."""
