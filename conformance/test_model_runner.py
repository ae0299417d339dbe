"""Collects the model runner suite against the configured backend."""

from __future__ import annotations

from .suite_model_runner import ModelRunnerSuite


class TestModelRunner(ModelRunnerSuite):
    """GLD-014 against ``--backend``."""
