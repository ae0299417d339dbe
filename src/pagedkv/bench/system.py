"""The one interface every system the benchmarks measure offers: pagedkv's engine,
transformers' ``generate`` and continuous batching, and vLLM's CPU backend alike.

A workload loads its systems (their models, their processes) before any clock starts, then
hands each the same requests in turn and reads the same :class:`~pagedkv.bench.run.RunResult`
back, whatever runs underneath.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedkv.bench.requests import BenchRequest
from pagedkv.bench.run import RunResult


class SystemUnderTest(Protocol):
    """A loaded system that runs a set of requests to completion and times it."""

    @property
    def name(self) -> str:
        """The system's name in the results, e.g. ``pagedkv-v1``."""
        ...

    def run(self, requests: Sequence[BenchRequest]) -> RunResult:
        """Submit every request at once (greedy, each generating exactly its ``max_tokens``),
        run them to completion; their counts and timings. What one call costs before its clock
        starts (a fresh engine, a cleared prefix cache) is the system's to pay, outside the
        timing.

        Precondition: ``requests`` is not empty.
        """
        ...
