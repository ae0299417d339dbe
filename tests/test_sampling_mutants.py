"""The sampling-controls suite (ENG-048) and the prompt-dict salt suite (ENG-062) can fail:
each mutant of ``tests/sampling_mutants.py`` fails every suite test it names, by an assertion
of the suite, and those tests pass on the reference. The runs are in this process
(``tests/suite_runs.py``), each ``pytest --pyargs <tests> --backend sampling_mutants:<name>``.
"""

from __future__ import annotations

import pytest
from sampling_mutants import SAMPLING_MUTANTS
from suite_runs import assert_caught, run_in_process

#: The suite modules these mutants are written against.
MODULES = ("test_engine_sampling", "test_engine_salt")


def test_what_catches_the_sampling_mutants_passes_on_the_reference() -> None:
    """Both modules pass on the reference, and every test a mutant names is one of theirs that
    ran and passed (a misspelt id would run nothing)."""
    names = sorted({name for m in SAMPLING_MUTANTS.values() for name in m.catches})
    run = run_in_process("pagedkv.backend:reference_backend", MODULES)
    assert run.code == 0, run.summary()
    assert {n: run.outcomes.get(n) for n in names} == dict.fromkeys(names, "passed"), run.summary()


@pytest.mark.spec("ENG-048", "ENG-062")
@pytest.mark.parametrize("name", sorted(SAMPLING_MUTANTS))
def test_suite_fails_on_sampling_mutant(name: str) -> None:
    """Each test the mutant names fails on it, by an assertion of the suite (not an error of
    the mutant's own making)."""
    mutant = SAMPLING_MUTANTS[name]
    assert_caught(run_in_process(f"sampling_mutants:{name}", mutant.catches), mutant.catches)
