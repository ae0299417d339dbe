"""The suite tests of issue 46's classes 2, 3 and 5, and those that took MUSTs over from the
project's tests, can fail: each fails on its mutant of
``tests/pressure_mutants.py`` by an assertion of the suite, and passes on the reference (both
prefix indexes) and on the reference store attending through gathers
(``tests/test_gathered_store_suite.py``). The runs are in this process
(``tests/suite_runs.py``)."""

from __future__ import annotations

import pytest
from pressure_mutants import PRESSURE_MUTANTS
from suite_runs import assert_caught, run_in_process

CATCHING = sorted({name for m in PRESSURE_MUTANTS.values() for name in m.catches})


@pytest.mark.spec(
    "ENG-130",
    "ENG-027",
    "KVM-034",
    "ENG-175",
    "PST-013",
    "PST-006",
    "ENG-053",
    "ENG-141",
    "ENG-120",
    "ENG-140",
    "ENG-152",
    "ENG-062",
    "ENG-142",
    "ENG-132",
    "ENG-144",
    "ENG-145",
    "ENG-049",
    "PST-018",
    "PST-016",
    "ENG-046",
    "ENG-048",
    "GLD-014",
    "GLD-033",
    "GLD-010",
    "GLD-011",
    "GLD-012",
    "GLD-013",
    "GLD-041",
    "GLD-032",
    "GLD-016",
    "ENG-178",
)
@pytest.mark.parametrize("name", sorted(PRESSURE_MUTANTS))
def test_suite_fails_on_pressure_mutant(name: str) -> None:
    """Each test the mutant names fails on it, not with an error of the mutant's making."""
    mutant = PRESSURE_MUTANTS[name]
    assert_caught(run_in_process(f"pressure_mutants:{name}", mutant.catches), mutant.catches)


@pytest.mark.parametrize(
    "backend", ["pagedkv.backend:reference_backend", "pagedkv.backend:radix_backend"]
)
def test_what_catches_them_passes_on_the_reference(backend: str) -> None:
    """Else the mutants' failures would prove nothing; every named test exists and ran."""
    run = run_in_process(backend, CATCHING)
    assert run.code == 0, run.summary()
    assert {n: o for n, o in run.outcomes.items() if n in CATCHING} == dict.fromkeys(
        CATCHING, "passed"
    ), run.summary()
