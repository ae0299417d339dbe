"""Turn the conformance run's JUnit XML into the result table of conformance/README.md.

Inputs: one JUnit XML report per backend (written with ``-p pagedkv_vllm.junit_specs``, so
each test carries the requirement IDs it cites), the variants the backend declares (the suite's
``pagedkv_conformance.variants`` says which tests each declared choice makes fail, and which
requirement it departs from; :mod:`pagedkv_vllm.variants` says why vLLM declares it), and
``specs/kv-manager.md`` for the list of requirements.

A requirement's status on a backend:

* **fails**: a test citing it failed unexpectedly (or passed while a declared variant said it
  would fail);
* **variant** ``name=choice``: the backend declares a choice that departs from the
  requirement's text and a test citing it fails through that choice (or the choice cannot be
  observed);
* **meets** (*n* of *m* tests): *n* of the *m* tests citing it passed, and the others fail
  only through variants that leave this requirement's text alone (the state machine, which
  cites most requirements, is one of them on vLLM);
* **not shown**: every test citing it fails through a variant that concerns something else;
* **not tested**: no test of the KVManager suite cites it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv_conformance.variants import VARIANTS, Choice, departures, expected_failures

from .variants import NOTES, Note

_REQUIREMENT = re.compile(r"^- \*\*(KVM-\d+)\*\* (MUST|SHOULD)(?: \(project\))? — (.*)$")
_SECTION = re.compile(r"^## (.*)$")


@dataclass(frozen=True)
class Requirement:
    """One requirement of specs/kv-manager.md."""

    id: str
    level: str
    section: str


@dataclass(frozen=True)
class TestResult:
    """One test case of a JUnit report.

    Attributes:
        node_id: ``file.py::Class::test[param]``, the form the expected-failures files use.
        outcome: ``passed``, ``failed``, ``xfailed`` or ``skipped``.
        specs: requirement IDs the test cites.
        seconds: its run time.
    """

    node_id: str
    outcome: str
    specs: tuple[str, ...]
    seconds: float


@dataclass
class BackendRun:
    """What one backend's run produced, for the table.

    Attributes:
        title: column heading.
        results: every test case.
        declared: the backend's choice in every variant (defaults included).
        seconds: wall time of the pytest run, vLLM's import included.
        xfail_variants: for each test the declared choices make fail, those choices
            (``name=choice``).
    """

    title: str
    results: list[TestResult]
    declared: Mapping[str, str]
    seconds: float
    xfail_variants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.xfail_variants = expected_failures(self.declared)
        for result in self.results:
            self.counts[result.outcome] = self.counts.get(result.outcome, 0) + 1


def read_requirements(spec: Path) -> list[Requirement]:
    """The requirements of a spec file, in order, with their section titles."""
    section = ""
    found = []
    for line in spec.read_text(encoding="utf-8").splitlines():
        if heading := _SECTION.match(line):
            section = heading.group(1)
        elif requirement := _REQUIREMENT.match(line):
            found.append(Requirement(requirement.group(1), requirement.group(2), section))
    return found


def read_junit(path: Path) -> list[TestResult]:
    """Every test case of a JUnit XML report (``junit_family=xunit1``)."""
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        node_id = f"{module.rpartition('.')[2]}.py::{cls}::{case.get('name', '')}"
        specs: tuple[str, ...] = ()
        for prop in case.iter("property"):
            if prop.get("name") == "spec":
                specs = tuple(prop.get("value", "").split())
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif (skipped := case.find("skipped")) is not None:
            outcome = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            outcome = "passed"
        results.append(TestResult(node_id, outcome, specs, float(case.get("time", "0"))))
    return results


def _listed_variants(run: BackendRun, result: TestResult) -> tuple[str, ...]:
    for node_id, names in run.xfail_variants.items():
        if result.node_id == node_id or result.node_id.endswith("/" + node_id):
            return names
    return ()


def status(requirement: Requirement, run: BackendRun) -> str:
    """The cell of ``requirement`` in ``run``'s column (see the module docstring)."""
    citing = [r for r in run.results if requirement.id in r.specs]
    failed = [r for r in citing if r.outcome == "failed"]
    if failed:
        return f"**fails**: {', '.join(_test_name(r) for r in failed)}"
    through = {name for r in citing if r.outcome == "xfailed" for name in _listed_variants(run, r)}
    departing = sorted(
        declared
        for name, declared in departures(run.declared).items()
        if requirement.id in _choice(name, run).departs_from
        and (declared in through or not _choice(name, run).observable)
    )
    if departing:
        return "variant " + ", ".join(f"[{d}](#{_anchor(d)})" for d in departing)
    passed = [r for r in citing if r.outcome == "passed"]
    if passed:
        return f"meets ({len(passed)} of {len(citing)} tests)"
    if through:
        return f"not shown (its tests fail through {', '.join(sorted(through))})"
    return "not tested"


def _choice(name: str, run: BackendRun) -> Choice:
    """The suite's ``Choice`` the backend declared in variant ``name``."""
    return VARIANTS[name].choices[run.declared[name]]


def _anchor(declared: str) -> str:
    return declared.replace("=", "-")


def _test_name(result: TestResult) -> str:
    return result.node_id.rpartition("::")[2]


def _summary(run: BackendRun) -> str:
    outcomes = ("passed", "xfailed", "failed", "skipped")
    parts = [f"{run.counts[k]} {k}" for k in outcomes if k in run.counts]
    return f"{', '.join(parts)} in {run.seconds:.0f} s"


def render(
    requirements: Sequence[Requirement],
    runs: Sequence[BackendRun],
    environment: str,
    total_seconds: float,
) -> str:
    """The markdown section: the requirement table, the failing tests, the variants."""
    lines = [
        "| Requirement | Level | " + " | ".join(run.title for run in runs) + " |",
        "|---|---|" + "---|" * len(runs),
    ]
    for requirement in requirements:
        cells = " | ".join(status(requirement, run) for run in runs)
        lines.append(
            f"| {requirement.id} ({requirement.section}) | {requirement.level} | {cells} |"
        )
    lines += ["", "Tests that fail on vLLM, and the declared variants that make them fail:"]
    lines += ["", "| Test | " + " | ".join(run.title for run in runs) + " |"]
    lines += ["|---|" + "---|" * len(runs)]
    failing = sorted({r.node_id for run in runs for r in run.results if r.outcome != "passed"})
    for node_id in failing:
        outcomes = [_outcome(node_id, run) for run in runs]
        lines.append(f"| `{_test_name_from(node_id)}` | " + " | ".join(outcomes) + " |")
    lines += [""]
    lines += [f"Run: {environment}; total {total_seconds:.0f} s (`make conformance-vllm`)."]
    for run in runs:
        lines.append(f"* {run.title}: {_summary(run)}.")
    names = sorted(
        {_test_name_from(r.node_id).partition("[")[0] for run in runs for r in run.results}
    )
    lines += ["", f"{SUITE_TESTS_RUN} ({len(names)}): " + ", ".join(f"`{n}`" for n in names) + "."]
    lines += ["", "### The variants", ""]
    for note in _declared(runs):
        lines += _render_variant(note, runs)
    return "\n".join(lines) + "\n"


#: Opens the line naming every suite test the runs ran (parameters dropped), by which a test of
#: the project checks that the table is no older than the suite.
SUITE_TESTS_RUN = "Suite tests run"


def _outcome(node_id: str, run: BackendRun) -> str:
    result = next((r for r in run.results if r.node_id == node_id), None)
    if result is None:
        return "not run"
    if result.outcome == "xfailed":
        return "xfail: " + ", ".join(_listed_variants(run, result))
    return result.outcome


def _test_name_from(node_id: str) -> str:
    return node_id.partition("::")[2]


def _declared(runs: Iterable[BackendRun]) -> list[Note]:
    """The notes of every choice some backend declares, in :data:`NOTES` order."""
    names = {name for run in runs for name in departures(run.declared)}
    return [note for name, note in NOTES.items() if name in names]


def _render_variant(note: Note, runs: Sequence[BackendRun]) -> list[str]:
    declared = f"{note.variant}={note.choice}"
    declared_by = [run.title for run in runs if run.declared.get(note.variant) == note.choice]
    choice = VARIANTS[note.variant].choices[note.choice]
    fails = ", ".join(f"`{t.rpartition('::')[2]}`" for t in choice.fails) or "none"
    departs = ", ".join(choice.departs_from) or "none (the spec leaves room: the suite follows it)"
    return [
        f'<a id="{_anchor(declared)}"></a>**{declared}** (declared by: {"; ".join(declared_by)}; '
        f"departs from: {departs}; expected failures: {fails})",
        "",
        f"* vLLM: {note.behaviour}",
        f"* pagedkv: {note.default}",
        f"* Observed by: {note.affects}",
        f"* Safe? {note.safety}",
        f"* Evidence: {note.evidence}",
        "",
    ]


def splice(readme: Path, section: str, begin: str, end: str) -> None:
    """Replace the text between the ``begin`` and ``end`` marker lines of ``readme``."""
    text = readme.read_text(encoding="utf-8")
    head, found_begin, rest = text.partition(begin + "\n")
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"{readme} lacks the markers {begin!r} ... {end!r}")
    readme.write_text(head + begin + "\n" + section + end + tail, encoding="utf-8")
