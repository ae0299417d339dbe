"""The fork suite can fail: it fails on every mutant of ``tests/fork_mutants.py`` (and passes
on the reference, which ``make test`` runs through the whole conformance suite)."""

from __future__ import annotations

import re

import pytest
from fork_mutants import FORK_MUTANTS
from test_mutants import EXIT_TESTS_FAILED, failed_tests, run_suite

FORK_SUITE = ("pagedkv_conformance.test_kv_fork",)


@pytest.mark.spec("KVM-037", "KVM-038", "KVM-039")
@pytest.mark.parametrize("factory", sorted(FORK_MUTANTS))
def test_fork_suite_fails_on_mutant(factory: str) -> None:
    """The fork suite fails on the mutant with failing tests, not with a usage error."""
    code, output = run_suite(f"fork_mutants:{factory}", modules=FORK_SUITE)
    assert code == EXIT_TESTS_FAILED, f"exit {code}:\n{output[-3000:]}"
    assert failed_tests(output), output[-3000:]
    assert not re.search(r"\d+ errors?\b", output), output[-3000:]


def test_fork_suite_passes_on_the_reference() -> None:
    """Else the mutants' failures would prove nothing."""
    code, output = run_suite("pagedkv.backend:reference_backend", modules=FORK_SUITE)
    assert code == 0, output[-3000:]
