"""The fork suite can fail: it fails on every mutant of ``tests/fork_mutants.py`` (and passes
on the reference, which ``make test`` runs through the whole conformance suite). The runs are
in this process (``tests/suite_runs.py``)."""

from __future__ import annotations

import pytest
from fork_mutants import FORK_MUTANTS
from suite_runs import BROKEN_MUTANT, EXIT_TESTS_FAILED, run_in_process

FORK_SUITE = ("test_kv_fork",)


@pytest.mark.spec("KVM-037", "KVM-038", "KVM-039")
@pytest.mark.parametrize("factory", sorted(FORK_MUTANTS))
def test_fork_suite_fails_on_mutant(factory: str) -> None:
    """The fork suite fails on the mutant with failing tests, not with a usage error or an
    error of the mutant's own making."""
    run = run_in_process(f"fork_mutants:{factory}", FORK_SUITE)
    assert run.code == EXIT_TESTS_FAILED, run.summary()
    failed = run.failed()
    assert failed, run.summary()
    assert "error" not in run.outcomes.values(), run.summary()
    assert not any(run.crashes[n].startswith(BROKEN_MUTANT) for n in failed), run.summary()


def test_fork_suite_passes_on_the_reference() -> None:
    """Else the mutants' failures would prove nothing."""
    run = run_in_process("pagedkv.backend:reference_backend", FORK_SUITE)
    assert run.code == 0, run.summary()
