"""Helpers for tests, the conformance suite and benchmarks: tiny deterministic checkpoints."""
