"""Run parts of the conformance suite against a backend, in this process or in a subprocess.

In-process runs (:func:`run_in_process`) call ``pytest.main`` on chosen tests of the
``pagedkv_conformance`` package with ``--backend``: no interpreter start, no torch import, a
second or less for a handful of tests. They are what the mutant checks use, hundreds of tests
across dozens of backends. A subprocess run (:func:`run_suite`) is how a third party runs the
suite; the plugin's command-line checks use it.

Node ids are written relative to the package, ``module::Class::test[param]``
(``test_kv_manager::TestKVManager::test_x``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
PACKAGE = "pagedkv_conformance"
EXIT_TESTS_FAILED = 1
EXIT_USAGE_ERROR = 4
#: A mutant failing a test with one of these is broken itself, not caught by the test.
BROKEN_MUTANT = ("TypeError", "AttributeError", "NameError", "ImportError", "NotImplementedError")


def short_id(node_id: str) -> str:
    """``conformance/test_x.py::C::t[p]`` (or ``test_x.py::C::t[p]``) as ``test_x::C::t[p]``."""
    path, sep, rest = node_id.partition("::")
    return Path(path).stem + sep + rest


@dataclass(eq=False)  # a pytest plugin: hashed by identity when conftest hooks are subset
class _Recorder:
    """A pytest plugin keeping each test's outcome and, for failures, the crash line."""

    outcomes: dict[str, str] = field(default_factory=dict)
    crashes: dict[str, str] = field(default_factory=dict)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = short_id(report.nodeid)
        if report.failed:
            if self.outcomes.get(name) != "failed":  # a teardown error after a failure
                self.outcomes[name] = "failed" if report.when == "call" else "error"
                crash = getattr(report.longrepr, "reprcrash", None)
                self.crashes[name] = str(getattr(crash, "message", report.longrepr))[:2000]
        elif report.when == "call" or report.skipped:
            self.outcomes[name] = report.outcome


@dataclass(frozen=True)
class SuiteRun:
    """What one run of suite tests gave.

    Attributes:
        code: pytest's exit code.
        outcomes: each test that ran (short id) and ``passed``, ``failed``, ``error`` (in a
            fixture) or ``skipped``.
        crashes: the failing line of each test that failed or errored.
    """

    code: int
    outcomes: dict[str, str]
    crashes: dict[str, str]

    def failed(self) -> list[str]:
        return sorted(n for n, o in self.outcomes.items() if o in ("failed", "error"))

    def summary(self) -> str:
        lines = [f"exit {self.code}"]
        lines += [f"{o:8} {n}" for n, o in sorted(self.outcomes.items())]
        lines += [f"  {n}: {c}" for n, c in sorted(self.crashes.items())]
        return "\n".join(lines)


@contextmanager
def _suite_environment(profile: str) -> Iterator[None]:
    """The environment a suite run sees: no backend or expected-failures file from outside,
    the Hypothesis profile asked for; and this process's Hypothesis profile restored after
    (the plugin loads its own for the run)."""
    from hypothesis import settings

    saved = {k: os.environ.get(k) for k in ("PAGEDKV_BACKEND", "PAGEDKV_XFAIL")}
    saved_profile = os.environ.get("PAGEDKV_HYPOTHESIS_PROFILE")
    current = settings.get_current_profile_name()
    for key in saved:
        os.environ.pop(key, None)
    os.environ["PAGEDKV_HYPOTHESIS_PROFILE"] = profile
    try:
        yield
    finally:
        for key, value in (*saved.items(), ("PAGEDKV_HYPOTHESIS_PROFILE", saved_profile)):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        settings.load_profile(current)


def run_in_process(
    backend: str, tests: Sequence[str], *args: str, profile: str = "ci", quiet: bool = True
) -> SuiteRun:
    """Run ``tests`` (package-relative node ids, or whole modules) of the suite on ``backend``
    in this process. ``tests/`` is on ``sys.path`` in a run of this test directory, so
    ``mutants:<name>`` imports. What pytest prints goes to this process's stdout and stderr
    (``capfd`` reads it)."""
    recorder = _Recorder()
    targets = [f"{PACKAGE}.{t}" for t in tests]
    with _suite_environment(profile):
        code = pytest.main(
            [
                *(["-q"] if quiet else []),
                "-p",
                "no:cacheprovider",
                "--rootdir",
                str(ROOT),
                "--pyargs",
                *targets,
                "--backend",
                backend,
                *args,
            ],
            plugins=[recorder],
        )
    return SuiteRun(int(code), recorder.outcomes, recorder.crashes)


def run_suite(
    backend: str,
    *args: str,
    modules: tuple[str, ...],
    quiet: bool = True,
    cwd: Path = ROOT,
) -> tuple[int, str]:
    """Run suite ``modules`` on ``backend`` in a subprocess from ``cwd``, as a third party
    would (``tests/`` on ``PYTHONPATH``, the bounded ``ci`` profile); returns the exit code and
    the output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH")) if p)
    env["PAGEDKV_HYPOTHESIS_PROFILE"] = "ci"
    env.pop("PAGEDKV_BACKEND", None)
    env.pop("PAGEDKV_XFAIL", None)
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


def assert_caught(run: SuiteRun, catches: Sequence[str]) -> None:
    """Every test of ``catches`` ran and failed by an assertion of the suite, not by an error
    of the backend's own making (a broken mutant proves nothing)."""
    assert run.code == EXIT_TESTS_FAILED, run.summary()
    for name in catches:
        assert run.outcomes.get(name) == "failed", f"{name} did not fail:\n{run.summary()}"
        crash = run.crashes[name]
        assert not crash.startswith(BROKEN_MUTANT), f"{name} failed by an error: {crash}"
