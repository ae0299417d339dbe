"""KVM-065: a backend declaring the page sizes its KVManager takes is tested at those only.

The runs are in this process (``tests/suite_runs.py``) on backends of ``tests/mutants``.
"""

from __future__ import annotations

import re

import pytest
from suite_runs import EXIT_USAGE_ERROR, run_in_process

#: The KVManager modules whose tests make managers of several page sizes.
MODULES = ("test_kv_manager", "test_kv_state_machine")
SIZED = "test_kv_manager::TestKVManager::test_a_manager_has_the_page_size_it_was_made_with"


@pytest.mark.spec("KVM-065")
def test_undeclared_page_sizes_are_skipped_naming_the_size(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The reference declaring page size 2 only passes; every test needing another size is
    skipped with a reason naming that size, the size-2 case runs, and so does the state
    machine (at size 2)."""
    run = run_in_process("mutants:page_sizes_of_two", MODULES, "-rs")
    out, err = capfd.readouterr()
    assert run.code == 0, run.summary()
    assert run.outcomes[f"{SIZED}[2]"] == "passed", run.summary()
    for size in (1, 16, 256):
        assert run.outcomes[f"{SIZED}[{size}]"] == "skipped", run.summary()
    state_machine = "test_kv_state_machine::TestKVStateMachine::test_kv_manager_matches_the_oracle"
    assert run.outcomes[state_machine] == "passed", run.summary()
    reasons = re.findall(r"does not declare page size (\d+)", out + err)
    assert reasons, out[-3000:]
    assert "2" not in reasons, out[-3000:]


@pytest.mark.spec("KVM-065")
def test_page_sizes_must_be_a_container(capfd: pytest.CaptureFixture[str]) -> None:
    """Page sizes declared as a bare int stop the run with a usage error saying the form."""
    run = run_in_process("mutants:page_sizes_as_an_int", MODULES, "--co")
    out, err = capfd.readouterr()
    assert run.code == EXIT_USAGE_ERROR, (out + err)[-3000:]
    assert "'page_sizes' must be a container of ints" in out + err, (out + err)[-3000:]
