"""The conformance suite can fail: it fails on every mutant in ``tests/mutants/`` (each room:
KVManager, PagedStore, engine, sampler) and passes on the reference and on correct backends that
declare another variant. Also checks the plugin's command-line behaviour (bad backends,
capability skips, the expected-failures file).

Each case runs the suite in a subprocess, as a third party would:
``python -m pytest --pyargs <suite> --backend mutants:<factory>`` with ``tests/`` on
``PYTHONPATH`` and the bounded ``ci`` Hypothesis profile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from mutants import CORRECT, MUTANTS

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
#: The KVManager part of the conformance package.
KV_SUITE = (
    "pagedkv_conformance.test_kv_manager",
    "pagedkv_conformance.test_kv_match",
    "pagedkv_conformance.test_kv_state_machine",
    "pagedkv_conformance.test_kv_variants",
)
EXIT_TESTS_FAILED = 1
EXIT_USAGE_ERROR = 4


def run_suite(
    backend: str,
    *args: str,
    modules: tuple[str, ...] = KV_SUITE,
    quiet: bool = True,
    cwd: Path = ROOT,
) -> tuple[int, str]:
    """Run the conformance suite on ``backend`` from ``cwd``; returns the exit code and the
    output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH")) if p)
    env["PAGEDKV_HYPOTHESIS_PROFILE"] = "ci"
    env.pop("PAGEDKV_BACKEND", None)
    command = [sys.executable, "-m", "pytest", "--pyargs", *modules, "--backend", backend]
    command += ["-q"] if quiet else []
    command += ["-p", "no:cacheprovider", *args]
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    return result.returncode, result.stdout + result.stderr


def failed_tests(output: str) -> list[str]:
    """Node ids of the ``FAILED`` lines of pytest's short summary."""
    return re.findall(r"^FAILED (\S+)", output, re.MULTILINE)


@pytest.fixture(scope="module")
def reference_passes() -> None:
    """The suite passes on the reference (else a mutant's failures would prove nothing)."""
    code, output = run_suite("pagedkv.backend:reference_backend")
    if code != 0:
        pytest.fail(f"the suite fails on the reference backend (exit {code}):\n{output[-6000:]}")


def test_suite_passes_on_the_reference(reference_passes: None) -> None:
    """``--backend pagedkv.backend:reference_backend``: every test passes."""


@pytest.fixture(scope="module")
def mutant_runs(reference_passes: None) -> Iterator[dict[str, Future[tuple[int, str]]]]:
    """Every mutant's run, started at once on as many workers as there are cores (each run is
    a subprocess, mostly waiting on its own imports)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        runs = {
            name: pool.submit(
                run_suite,
                f"mutants:{name}",
                "-x",
                *(("-k", mutant.select) if mutant.select else ()),
                modules=mutant.suites,
            )
            for name, mutant in sorted(MUTANTS.items())
        }
        yield runs
        for run in runs.values():
            run.cancel()


@pytest.mark.parametrize("factory", sorted(MUTANTS))
def test_suite_fails_on_mutant(
    mutant_runs: dict[str, Future[tuple[int, str]]], factory: str
) -> None:
    """The suite modules named for the mutant, stopped at their first failure (``-x``), fail
    with a failing test, not with a usage or collection error."""
    code, output = mutant_runs[factory].result()
    assert code == EXIT_TESTS_FAILED, f"exit {code}:\n{output[-3000:]}"
    assert failed_tests(output), output[-3000:]
    assert re.search(r"\b1 failed\b", output), output[-3000:]
    assert not re.search(r"\d+ errors?\b", output), output[-3000:]


@pytest.mark.parametrize("factory", sorted(CORRECT))
def test_suite_passes_on_correct_variants(factory: str) -> None:
    """A correct KVManager that differs from the reference where the spec leaves room
    (KVM-050) passes the KVManager suite, state machine included, once it declares its
    choice."""
    code, output = run_suite(f"mutants:{factory}")
    assert code == 0, f"exit {code}:\n{output[-3000:]}"


def test_every_issue_class_has_a_mutant() -> None:
    """Each class of gap the suite closed (continuing chunks, page order, stale data, text,
    order after preemption, sampling from below, the small requirements, variants) has a
    mutant that proves its tests can fail, and every room has mutants."""
    classes = {c for m in MUTANTS.values() for c in m.classes}
    assert classes == set(range(1, 9))
    assert {m.room for m in MUTANTS.values()} == {"kv", "store", "engine", "sampler"}


# -- the plugin ------------------------------------------------------------------------------


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
def test_bad_backend_is_a_usage_error(backend: str, message: str) -> None:
    """A malformed ``--backend``, a missing module or factory, a non-callable, or a factory
    returning something that is not a Backend stops the run with a clear usage error."""
    code, output = run_suite(backend, "--co")
    assert code == EXIT_USAGE_ERROR, output[-3000:]
    assert message in output, output[-3000:]


def test_report_header_names_the_backend() -> None:
    """The report header names the backend, where it came from, and its capabilities."""
    code, output = run_suite("mutants:mru_eviction", "--co", quiet=False)
    assert code == 0, output[-3000:]
    name = MUTANTS["mru_eviction"].build().name
    assert f"pagedkv backend: {name} = mutants:mru_eviction (--backend)" in output, output
    assert "pagedkv capabilities: eviction, prefix_caching, reset" in output, output
    assert "pagedkv variants: orphans=block" in output, output


def test_missing_capabilities_skip_with_the_reason() -> None:
    """On a backend declaring no capability, tests that require one are skipped with a reason
    naming it, and the rest pass."""
    code, output = run_suite(
        "mutants:no_capabilities", "-rs", modules=("pagedkv_conformance.test_kv_manager",)
    )
    assert code == 0, output[-3000:]
    assert re.search(r"SKIPPED .*does not declare capabilit.*'prefix_caching'", output), output
    assert re.search(r"\d+ passed, \d+ skipped", output), output[-3000:]


def test_expected_failures_file(tmp_path: Path) -> None:
    """Tests listed in ``--pagedkv-xfail`` run as strict expected failures: listing a
    mutant's failures makes the run pass; listing a passing test makes it fail (XPASS)."""
    module = ("pagedkv_conformance.test_kv_manager",)
    code, output = run_suite("mutants:mru_eviction", modules=module)
    failures = failed_tests(output)
    assert code == EXIT_TESTS_FAILED, output[-3000:]
    assert failures, output[-3000:]
    listed = tmp_path / "xfail.txt"
    lines = [f.split("/")[-1] for f in failures]  # file-relative ids match too
    listed.write_text("# known failures\n" + "\n".join(lines) + "\n", encoding="utf-8")
    code, output = run_suite("mutants:mru_eviction", f"--pagedkv-xfail={listed}", modules=module)
    assert code == 0, output[-3000:]
    assert f"{len(failures)} xfailed" in output, output[-3000:]
    passing = "test_kv_manager.py::TestKVManager::test_allocating_a_live_id_raises_duplicate"
    listed.write_text(passing + "\n", encoding="utf-8")
    code, output = run_suite(
        "pagedkv.backend:reference_backend", f"--pagedkv-xfail={listed}", modules=module
    )
    assert code == EXIT_TESTS_FAILED, output[-3000:]
    assert "XPASS(strict)" in output, output[-3000:]


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
