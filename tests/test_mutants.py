"""The conformance suite can fail: every mutant in ``tests/mutants/`` (each room: KVManager,
PagedStore, engine, sampler) fails the suite tests it names, and those tests pass on the
reference; correct backends that declare another variant pass the KVManager suite. Also checks
the plugin's command-line behaviour (bad backends, capability skips, the expected-failures
file).

The mutants run in this process (``tests/suite_runs.py``): each is ``pytest --pyargs
<the tests it names> --backend mutants:<name>`` through ``pytest.main``, a second or so apiece,
with the bounded ``ci`` Hypothesis profile. The plugin's checks run the suite in a subprocess,
as a third party would.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mutants import CORRECT, MUTANTS
from suite_runs import (
    EXIT_TESTS_FAILED,
    EXIT_USAGE_ERROR,
    assert_caught,
    run_in_process,
    run_suite,
)

#: The KVManager part of the conformance package.
KV_SUITE = (
    "test_kv_manager",
    "test_kv_match",
    "test_kv_state_machine",
    "test_kv_variants",
)
KV_MODULES = tuple(f"pagedkv_conformance.{m}" for m in KV_SUITE)


def test_what_catches_the_mutants_passes_on_the_reference() -> None:
    """Every test named as catching a mutant passes on the reference (else a mutant's
    failures would prove nothing) and exists (a misspelt id runs nothing)."""
    names = sorted({name for m in MUTANTS.values() for name in m.catches})
    run = run_in_process("pagedkv.backend:reference_backend", names)
    assert run.code == 0, run.summary()
    assert {n: o for n, o in run.outcomes.items() if n in names} == dict.fromkeys(
        names, "passed"
    ), run.summary()


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_suite_fails_on_mutant(name: str) -> None:
    """Each test the mutant names fails on it, by an assertion of the suite (not an error of
    the mutant's own making)."""
    mutant = MUTANTS[name]
    assert_caught(run_in_process(f"mutants:{name}", mutant.catches), mutant.catches)


@pytest.mark.parametrize("factory", sorted(CORRECT))
def test_suite_passes_on_correct_variants(factory: str) -> None:
    """A correct KVManager that differs from the reference where the spec leaves room
    (KVM-050) passes the KVManager suite, state machine included, once it declares its
    choice."""
    run = run_in_process(f"mutants:{factory}", KV_SUITE)
    assert run.code == 0, run.summary()
    assert "passed" in run.outcomes.values(), run.summary()


def test_every_issue_class_has_a_mutant() -> None:
    """Each class of gap the suite closed (continuing chunks, page order, stale data, text,
    order after preemption, sampling from below, the small requirements, variants) has a
    mutant that proves its tests can fail, and every room has mutants."""
    classes = {c for m in MUTANTS.values() for c in m.classes}
    assert classes == set(range(1, 9))
    assert {m.room for m in MUTANTS.values()} == {"kv", "store", "engine", "sampler"}


# -- the plugin ------------------------------------------------------------------------------


def _output(capfd: pytest.CaptureFixture[str]) -> str:
    out, err = capfd.readouterr()
    return out + err


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("no-colon", "malformed backend"),
        ("no_such_module_xyz:factory", "cannot import module"),
        ("mutants:no_such_factory", "has no attribute"),
        ("mutants:not_a_backend", "not a pagedkv.interfaces.Backend"),
        ("mutants:unknown_variant", "variant 'orphans' has no choice 'sometimes'"),
    ],
)
def test_bad_backend_is_a_usage_error(
    capfd: pytest.CaptureFixture[str], backend: str, message: str
) -> None:
    """A malformed ``--backend``, a missing module or factory, a non-callable, or a factory
    returning something that is not a Backend stops the run with a clear usage error."""
    run = run_in_process(backend, KV_SUITE, "--co")
    output = _output(capfd)
    assert run.code == EXIT_USAGE_ERROR, output[-3000:]
    assert message in output, output[-3000:]


def test_report_header_names_the_backend(capfd: pytest.CaptureFixture[str]) -> None:
    """The report header names the backend, where it came from, and its capabilities."""
    run = run_in_process("mutants:mru_eviction", KV_SUITE, "--co", quiet=False)
    output = _output(capfd)
    assert run.code == 0, output[-3000:]
    name = MUTANTS["mru_eviction"].build().name
    assert f"pagedkv backend: {name} = mutants:mru_eviction (--backend)" in output, output
    assert "pagedkv capabilities: eviction, prefix_caching, reset" in output, output
    assert "pagedkv variants: defaults" in output, output


def test_missing_capabilities_skip_with_the_reason(capfd: pytest.CaptureFixture[str]) -> None:
    """On a backend declaring no capability, tests that require one are skipped with a reason
    naming it, and the rest pass."""
    run = run_in_process("mutants:no_capabilities", ("test_kv_manager",), "-rs")
    output = _output(capfd)
    assert run.code == 0, output[-3000:]
    assert re.search(r"SKIPPED .*does not declare capabilit.*'prefix_caching'", output), output
    assert {"passed", "skipped"} <= set(run.outcomes.values()), run.summary()


def test_a_declared_departure_runs_what_it_breaks_as_expected_failures() -> None:
    """A backend declaring ``publication=on-schedule`` (and publishing when allocated) passes
    the KVManager example tests with exactly the tests the departure names run as expected
    failures; the reference declaring it fails the run, since those tests pass (strict)."""
    departing = {
        f"test_kv_manager::TestKVManager::{name}"
        for name in (
            "test_nothing_is_hit_before_commit",
            "test_only_full_pages_are_published",
            "test_stats_count_what_happened",
        )
    }
    run = run_in_process("mutants:publication_on_schedule_declared", ("test_kv_manager",))
    assert run.code == 0, run.summary()
    assert {n for n, o in run.outcomes.items() if o == "skipped"} == departing, run.summary()
    run = run_in_process(
        "mutants:publication_on_schedule_declared_falsely", tuple(sorted(departing))
    )
    assert run.code == EXIT_TESTS_FAILED, run.summary()
    assert set(run.failed()) == departing, run.summary()
    assert all("XPASS(strict)" in run.crashes[n] for n in departing), run.summary()


def test_variants_must_be_a_mapping_of_known_choices() -> None:
    """Declarations in any other form, or of unknown variants, stop the run (usage error)."""
    for factory in ("unknown_variant", "variants_as_names"):
        run = run_in_process(f"mutants:{factory}", ("test_kv_manager",), "--co")
        assert run.code == EXIT_USAGE_ERROR, factory


def test_expected_failures_file(tmp_path: Path) -> None:
    """Tests listed in ``--pagedkv-xfail`` run as strict expected failures: listing a
    mutant's failures makes the run pass; listing a passing test makes it fail (XPASS)."""
    module = ("test_kv_manager",)
    run = run_in_process("mutants:mru_eviction", module)
    failures = run.failed()
    assert run.code == EXIT_TESTS_FAILED, run.summary()
    assert failures, run.summary()
    listed = tmp_path / "xfail.txt"
    lines = [f.replace("::", ".py::", 1) for f in failures]  # file-relative ids
    listed.write_text("# known failures\n" + "\n".join(lines) + "\n", encoding="utf-8")
    run = run_in_process("mutants:mru_eviction", module, f"--pagedkv-xfail={listed}")
    assert run.code == 0, run.summary()
    assert not run.failed(), run.summary()
    assert len(failures) == sum(1 for n in failures if run.outcomes[n] == "skipped")
    passing = "test_kv_manager.py::TestKVManager::test_allocating_a_live_id_raises_duplicate"
    listed.write_text(passing + "\n", encoding="utf-8")
    run = run_in_process("pagedkv.backend:reference_backend", module, f"--pagedkv-xfail={listed}")
    assert run.code == EXIT_TESTS_FAILED, run.summary()
    assert run.failed() == [passing.replace(".py::", "::", 1)], run.summary()
    assert "XPASS(strict)" in run.crashes[run.failed()[0]], run.summary()


def test_expected_failures_match_outside_the_checkout(tmp_path: Path) -> None:
    """Run from another directory, as a third party would, where pytest leaves the file out
    of the node ids: file-relative ids in ``--pagedkv-xfail`` still match."""
    module = ("pagedkv_conformance.test_kv_manager",)
    failing = (
        "test_kv_manager.py::TestKVManager::"
        "test_eviction_is_lru_tail_first_and_only_when_free_list_is_empty"
    )
    listed = tmp_path / "xfail.txt"
    listed.write_text(failing + "\n", encoding="utf-8")
    code, output = run_suite(
        "mutants:mru_eviction",
        f"--pagedkv-xfail={listed}",
        "-k",
        "lru_tail_first",
        modules=module,
        cwd=tmp_path,
    )
    assert code == 0, output[-3000:]
    assert "1 xfailed" in output, output[-3000:]
    assert "expected failures not run" not in output, output[-3000:]
