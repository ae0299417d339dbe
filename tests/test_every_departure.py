"""pagedkv's reference under every declared departure passes the whole KVManager suite.

A variant (``pagedkv_conformance.variants``) is followed by the oracle and the example tests,
or lists the tests it makes fail as strict expected failures. Neither can be trusted from the
variant tests of one module: a choice whose oracle rule is missing, or whose list misses a
test of another module, only shows when a backend taking that choice runs every KV module.
So the reference is made to take each choice, one departure at a time (its factories in
``tests/mutants``), and runs the whole KV suite declaring it: nothing may fail, and exactly
the tests the choice lists run as expected failures. One departure at a time makes every
expected failure attributable to the departure that causes it: a test listed under one
choice but failing only because of another would pass here, and a strict expected failure
that passes fails the run.
"""

from __future__ import annotations

import pytest
from mutants import CORRECT, publication_on_schedule_declared
from mutants.backend import MutantBackend
from suite_runs import run_in_process

from pagedkv_conformance.variants import VARIANTS, declared_variants, departures, expected_failures

#: Every module of the KVManager suite.
WHOLE_KV_SUITE = (
    "test_kv_manager",
    "test_kv_match",
    "test_kv_fork",
    "test_kv_state_machine",
    "test_kv_variants",
)

#: ``mutants:<name>`` factories of the reference taking one choice other than the default.
DEPARTING = {
    **CORRECT,
    "publication_on_schedule_declared": publication_on_schedule_declared,
}

#: Non-default choices the reference is not made to take, and why.
NOT_TAKEN = {
    "hit-verification=hash-trusted": "no test can observe it (a hit trusted on a cryptographic "
    "hash cannot be told from a verified one)",
    "duplicates=published": "the reference has no index holding several pages under one "
    "prefix; the choice is shown on vLLM's manager (examples/vllm_backend)",
}


def _departure(factory: str) -> str:
    backend: MutantBackend = DEPARTING[factory]()
    chosen = departures(declared_variants(backend))
    assert len(chosen) == 1, f"{factory} departs in {sorted(chosen.values())}, not exactly one"
    return next(iter(chosen.values()))


def test_every_choice_is_taken_by_the_reference() -> None:
    """Each choice other than a variant's default is declared by exactly one of the
    reference's departing factories, each departing in one variant only, or is listed as not
    taken with its reason."""
    choices = {
        f"{name}={choice}"
        for name, variant in VARIANTS.items()
        for choice in variant.choices
        if choice != variant.default
    }
    taken = sorted(_departure(factory) for factory in DEPARTING)
    assert len(taken) == len(set(taken)), f"a choice is taken twice: {taken}"
    assert set(taken) | set(NOT_TAKEN) == choices
    assert not set(taken) & set(NOT_TAKEN)


@pytest.mark.parametrize("factory", sorted(DEPARTING))
def test_the_reference_departing_passes_the_whole_kv_suite(factory: str) -> None:
    """The reference declaring one departure runs every KV module: nothing fails, nothing is
    skipped, and exactly the tests the departure lists are expected failures (strict)."""
    backend = DEPARTING[factory]()
    listed = {
        node_id.replace(".py::", "::", 1)
        for node_id in expected_failures(declared_variants(backend))
    }
    run = run_in_process(f"mutants:{factory}", WHOLE_KV_SUITE)
    assert run.code == 0, run.summary()
    assert not run.failed(), run.summary()
    assert "passed" in run.outcomes.values(), run.summary()
    skipped = {name for name, outcome in run.outcomes.items() if outcome == "skipped"}
    assert skipped == listed, (
        f"{_departure(factory)}: run as expected failures {sorted(skipped)}, "
        f"listed {sorted(listed)}"
    )
