"""Turn the conformance run's JUnit XML into the result table of conformance/README.md.

Inputs: one JUnit XML report per backend (written with ``-p pagedkv_vllm.junit_specs``, so
each test carries the requirement IDs it cites), the backend's expected-failures file (each
line's comment names the variants that make the test fail), the variants of
:mod:`pagedkv_vllm.variants`, and ``specs/kv-manager.md`` for the list of requirements.

A requirement's status on a backend:

* **fails**: a test citing it failed unexpectedly (or passed while listed as expected to fail);
* **variant** ``name``: the backend declares a variant that departs from the requirement's text
  and a test citing it fails through that variant (or the variant cannot be observed);
* **meets** (*n* of *m* tests): *n* of the *m* tests citing it passed, and the others fail
  only through variants that leave this requirement's text alone (the state machine, which
  cites most requirements, is one of them on vLLM);
* **not shown**: every test citing it fails through a variant that concerns something else;
* **not tested**: no test of the KVManager suite cites it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .variants import VARIANTS, Variant

_REQUIREMENT = re.compile(r"^- \*\*(KVM-\d+)\*\* (MUST|SHOULD) — (.*)$")
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
        xfail_variants: for each listed node id, the variants its comment names.
        declared: the variants the backend declares.
        seconds: wall time of the pytest run, vLLM's import included.
    """

    title: str
    results: list[TestResult]
    xfail_variants: dict[str, tuple[str, ...]]
    declared: frozenset[str]
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
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


def read_expected_failures(path: Path) -> dict[str, tuple[str, ...]]:
    """Listed node id -> the variant names its comment gives (unknown names are refused)."""
    listed: dict[str, tuple[str, ...]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        node_id, _, comment = line.partition("#")
        if not node_id.strip():
            continue
        names = tuple(name.strip() for name in comment.split(",") if name.strip())
        unknown = [name for name in names if name not in VARIANTS]
        if not names or unknown:
            raise ValueError(
                f"{path}:{number}: a listed test's comment must name its variants "
                f"({', '.join(sorted(VARIANTS))}); got {comment.strip()!r}"
            )
        listed[node_id.strip()] = names
    return listed


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
        name
        for name in run.declared
        if requirement.id in VARIANTS[name].departs_from
        and (name in through or not VARIANTS[name].observable)
    )
    if departing:
        return "variant " + ", ".join(f"[{name}](#{name})" for name in departing)
    passed = [r for r in citing if r.outcome == "passed"]
    if passed:
        return f"meets ({len(passed)} of {len(citing)} tests)"
    if through:
        return f"not shown (its tests fail through {', '.join(sorted(through))})"
    return "not tested"


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
    lines += ["", "Tests that fail on vLLM, and the variants their expected-failures lines name:"]
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
    lines += ["", "### The variants", ""]
    for variant in _declared(runs):
        lines += _render_variant(variant, runs)
    return "\n".join(lines) + "\n"


def _outcome(node_id: str, run: BackendRun) -> str:
    result = next((r for r in run.results if r.node_id == node_id), None)
    if result is None:
        return "not run"
    if result.outcome == "xfailed":
        return "xfail: " + ", ".join(_listed_variants(run, result))
    return result.outcome


def _test_name_from(node_id: str) -> str:
    return node_id.partition("::")[2]


def _declared(runs: Iterable[BackendRun]) -> list[Variant]:
    names = set().union(*(run.declared for run in runs))
    return [variant for name, variant in VARIANTS.items() if name in names]


def _render_variant(variant: Variant, runs: Sequence[BackendRun]) -> list[str]:
    declared_by = [run.title for run in runs if variant.name in run.declared]
    departs = ", ".join(variant.departs_from) or "none (the spec leaves room; the oracle's choice)"
    return [
        f'<a id="{variant.name}"></a>**{variant.name}** (declared by: {"; ".join(declared_by)}; '
        f"departs from: {departs})",
        "",
        f"* vLLM: {variant.behaviour}",
        f"* pagedkv: {variant.default}",
        f"* Observed by: {variant.affects}",
        f"* Safe? {variant.safety}",
        f"* Evidence: {variant.evidence}",
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
