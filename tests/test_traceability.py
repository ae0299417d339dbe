"""Traceability: every MUST in specs/*.md has a test, and every test cites real requirements.

Requirements are lines ``- **KVM-001** MUST — ...`` (or SHOULD) in ``specs/*.md``. Tests cite
them with ``@pytest.mark.spec("KVM-001", ...)``; citations are found statically (``ast``) in
every ``.py`` file under ``tests/`` and ``conformance/``, so a test counts wherever it lives and
whatever backend capabilities it needs.

A MUST holds any backend unless its line is tagged ``MUST (project)``: a requirement on
pagedkv's own implementation (its loader, kernels, runner options, ``LLM``, command line,
tensor parallelism, module layout), which no suite test can check on another backend. Every
other MUST must be cited by a test of the conformance suite (``conformance/``), not only by the
project's tests (``tests/``); the ones still held only by the project's tests are listed in
:data:`AWAITING_SUITE_TESTS`, which must shrink, never grow (run this file as a script to print
the split).

The suite has two halves: the conformance package judges backends of pagedkv's Protocols, and
``pagedkv certify`` judges whole servers over HTTP. A certify check names the serving
requirements it certifies in its ``spec_ids`` (CRT-006); those citations count as the suite's
(its CRT IDs name the check's own requirements, which the project's tests hold). Every check is
shown failing against a server made wrong for it in ``tests/test_certify.py`` (CRT-007).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC_DIR = ROOT / "specs"
SOURCE_DIRS = (ROOT / "tests", ROOT / "conformance")
#: The checks of ``pagedkv certify``, whose ``spec_ids`` cite what they certify of a server.
CERTIFY_CHECKS = ROOT / "src" / "pagedkv" / "certify" / "checks"

REQUIREMENT = re.compile(
    r"^- \*\*([A-Z]{2,3}-\d{3})\*\* (MUST|SHOULD)(?: \((project)\))?", re.MULTILINE
)
#: Where the conformance suite's citations live (labels are paths from the repository root).
SUITE_PREFIX = "conformance/"
#: Where certify's citations live: the suite's other half, for whole servers.
CERTIFY_PREFIX = "src/pagedkv/certify/checks/"

#: MUSTs any backend is held to that only the project's tests cite so far: each needs a suite
#: test or certify check (or, if it turns out to be about pagedkv's implementation, the
#: ``(project)`` tag). None is left; a new requirement must come with its suite test.
AWAITING_SUITE_TESTS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Requirement:
    """One requirement line of a spec."""

    req_id: str
    level: str  # "MUST" or "SHOULD"
    where: str  # file:line
    project: bool = False  # tagged "(project)": about pagedkv's own implementation


@dataclass
class Citation:
    """One ``mark.spec`` argument in a source file."""

    req_id: str
    where: str  # file:line


@dataclass
class TraceReport:
    """What the scan found; each list is a problem unless empty."""

    requirements: dict[str, Requirement] = field(default_factory=dict)
    citations: list[Citation] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    not_literal: list[str] = field(default_factory=list)

    @property
    def cited(self) -> set[str]:
        return {c.req_id for c in self.citations}

    @property
    def untested_musts(self) -> list[Requirement]:
        cited = self.cited
        return [
            r for r in self.requirements.values() if r.level == "MUST" and r.req_id not in cited
        ]

    @property
    def suite_cited(self) -> set[str]:
        """IDs cited by a test of the conformance suite or certified by a certify check."""
        return {
            c.req_id
            for c in self.citations
            if c.where.startswith(SUITE_PREFIX) or c.where.startswith(CERTIFY_PREFIX)
        }

    @property
    def project_only_musts(self) -> list[Requirement]:
        """MUSTs any backend is held to that tests cite, but no suite test does."""
        cited, suite = self.cited, self.suite_cited
        return [
            r
            for r in self.requirements.values()
            if r.level == "MUST" and not r.project and r.req_id in cited - suite
        ]

    @property
    def project_scoped_in_suite(self) -> list[Requirement]:
        """Requirements tagged ``(project)`` that the suite cites: the tag is wrong."""
        suite = self.suite_cited
        return [r for r in self.requirements.values() if r.project and r.req_id in suite]

    @property
    def unknown_citations(self) -> list[Citation]:
        return [c for c in self.citations if c.req_id not in self.requirements]


def parse_requirements(path: Path, report: TraceReport) -> None:
    """Add the requirement lines of one spec file to ``report``."""
    text = path.read_text(encoding="utf-8")
    for match in REQUIREMENT.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        req = Requirement(
            match.group(1), match.group(2), f"{path.name}:{line}", match.group(3) is not None
        )
        if req.req_id in report.requirements:
            first = report.requirements[req.req_id].where
            report.duplicates.append(f"{req.req_id} at {req.where} (first at {first})")
        else:
            report.requirements[req.req_id] = req


def _is_spec_mark(func: ast.expr) -> bool:
    """``pytest.mark.spec`` or ``mark.spec`` (however ``pytest`` or ``mark`` was imported)."""
    if not (isinstance(func, ast.Attribute) and func.attr == "spec"):
        return False
    owner = func.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (
        isinstance(owner, ast.Name) and owner.id == "mark"
    )


def scan_citations(path: Path, report: TraceReport, label: str | None = None) -> None:
    """Add every ``mark.spec(...)`` argument of one Python file to ``report``."""
    name = label or path.name
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_spec_mark(node.func):
            for arg in node.args:
                where = f"{name}:{arg.lineno}"
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    report.citations.append(Citation(arg.value, where))
                else:
                    report.not_literal.append(where)


def scan_certified(path: Path, report: TraceReport, label: str | None = None) -> None:
    """Add the IDs a certify check's ``spec_ids = (...)`` names, but its own CRT ones, to
    ``report`` (CRT-006)."""
    name = label or path.name
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if not (isinstance(target, ast.Name) and target.id == "spec_ids"):
            continue
        if not isinstance(value, ast.Tuple):
            report.not_literal.append(f"{name}:{node.lineno}")
            continue
        for element in value.elts:
            where = f"{name}:{element.lineno}"
            if not (isinstance(element, ast.Constant) and isinstance(element.value, str)):
                report.not_literal.append(where)
            elif not element.value.startswith("CRT-"):
                report.citations.append(Citation(element.value, where))


def trace(
    spec_files: Iterable[Path],
    source_files: Iterable[tuple[Path, str]],
    certify_files: Iterable[tuple[Path, str]] = (),
) -> TraceReport:
    """Scan specs, sources and certify checks (``(path, label)`` pairs) into one report."""
    report = TraceReport()
    for path in sorted(spec_files):
        parse_requirements(path, report)
    for path, label in sorted(source_files):
        scan_citations(path, report, label)
    for path, label in sorted(certify_files):
        scan_certified(path, report, label)
    return report


def project_report() -> TraceReport:
    """The report for this repository: specs/*.md against tests/, conformance/ and certify's
    checks."""
    sources = [
        (path, str(path.relative_to(ROOT)))
        for folder in SOURCE_DIRS
        for path in folder.rglob("*.py")
        if "__pycache__" not in path.parts
    ]
    checks = [(path, str(path.relative_to(ROOT))) for path in CERTIFY_CHECKS.glob("*.py")]
    return trace(SPEC_DIR.glob("*.md"), sources, checks)


# -- the project's traceability --------------------------------------------------------------


def test_specs_define_requirements_once() -> None:
    """Every spec file's requirements parse, KVM's among them, and no ID is defined twice."""
    report = project_report()
    assert any(r.startswith("KVM-") for r in report.requirements)
    assert any(r.level == "MUST" for r in report.requirements.values())
    assert not report.duplicates, "requirement IDs defined twice:\n" + "\n".join(report.duplicates)


def test_every_must_has_a_test() -> None:
    """Each MUST requirement is cited by at least one ``@pytest.mark.spec``."""
    missing = project_report().untested_musts
    assert not missing, "MUST requirements without a test:\n" + "\n".join(
        f"  {r.req_id} ({r.where})" for r in missing
    )


@pytest.mark.spec("CRT-006")
def test_musts_any_backend_meets_have_suite_tests() -> None:
    """Every MUST not tagged ``(project)`` that the project's tests cite is cited by a suite
    test too, but those listed in :data:`AWAITING_SUITE_TESTS`; the list names exactly the
    ones still awaiting (one that gained a suite test, or a tag, is struck from it), and no
    ``(project)`` requirement is cited by the suite."""
    report = project_report()
    only = {r.req_id for r in report.project_only_musts}
    new = sorted(only - AWAITING_SUITE_TESTS)
    done = sorted(AWAITING_SUITE_TESTS - only)
    assert not new, "MUSTs only the project's tests hold (add a suite test):\n" + "\n".join(
        f"  {r}" for r in new
    )
    assert not done, "no longer awaiting a suite test (strike from the list):\n" + "\n".join(
        f"  {r}" for r in done
    )
    wrong = [f"  {r.req_id} ({r.where})" for r in report.project_scoped_in_suite]
    assert not wrong, "(project) requirements the suite cites:\n" + "\n".join(wrong)


def test_every_cited_id_exists() -> None:
    """Each ``@pytest.mark.spec`` argument is a string literal naming a defined requirement."""
    report = project_report()
    unknown = [f"  {c.req_id} cited at {c.where}" for c in report.unknown_citations]
    unknown += [f"  non-literal citation at {where}" for where in report.not_literal]
    assert not unknown, "citations of unknown requirements:\n" + "\n".join(unknown)


# -- the scanner itself ----------------------------------------------------------------------

SYNTHETIC_SPEC = """\
# Synthetic requirements (XYZ)

- **XYZ-001** MUST — the first thing.
- **XYZ-002** MUST — the second thing,
  over two lines.
- **XYZ-003** SHOULD — a nicety; needs no test.
Prose mentioning **XYZ-004** MUST is not a requirement line.
"""

SYNTHETIC_TESTS = """\
import pytest
from pytest import mark

pytestmark = pytest.mark.spec("XYZ-003")


@pytest.mark.spec("XYZ-001", "XYZ-009")
def test_one():
    pass


@mark.spec("XYZ-001")
def test_two():
    pass


@pytest.mark.parametrize("x", [pytest.param(1, marks=pytest.mark.spec("ABC-001"))])
def test_three(x):
    pass


IDS = ("XYZ-002",)


@pytest.mark.spec(*IDS)
def test_four():
    pass


@pytest.mark.other("XYZ-002")
def test_five():
    pass
"""


def _synthetic(tmp_path: Path, spec: str, tests: str) -> TraceReport:
    (tmp_path / "xyz.md").write_text(spec, encoding="utf-8")
    (tmp_path / "test_xyz.py").write_text(tests, encoding="utf-8")
    return trace([tmp_path / "xyz.md"], [(tmp_path / "test_xyz.py", "test_xyz.py")])


def test_scanner_finds_gaps_and_unknown_ids(tmp_path: Path) -> None:
    """On a synthetic spec and test file, the scanner parses MUST/SHOULD lines only, finds
    citations in decorators, module marks and params, reports the untested MUST, the
    unknown IDs with their lines and the non-literal citation, and ignores other markers."""
    report = _synthetic(tmp_path, SYNTHETIC_SPEC, SYNTHETIC_TESTS)
    assert {r: v.level for r, v in report.requirements.items()} == {
        "XYZ-001": "MUST",
        "XYZ-002": "MUST",
        "XYZ-003": "SHOULD",
    }
    assert report.requirements["XYZ-002"].where == "xyz.md:4"
    assert report.cited == {"XYZ-001", "XYZ-003", "XYZ-009", "ABC-001"}
    assert [r.req_id for r in report.untested_musts] == ["XYZ-002"]
    assert sorted((c.req_id, c.where) for c in report.unknown_citations) == [
        ("ABC-001", "test_xyz.py:17"),
        ("XYZ-009", "test_xyz.py:7"),
    ]
    assert report.not_literal == ["test_xyz.py:25"]
    assert not report.duplicates


def test_scanner_passes_a_complete_example_and_flags_duplicates(tmp_path: Path) -> None:
    """A fully cited spec yields no problem; an ID defined twice is reported."""
    report = _synthetic(
        tmp_path,
        SYNTHETIC_SPEC,
        'import pytest\n\n@pytest.mark.spec("XYZ-001", "XYZ-002")\ndef test_all():\n    pass\n',
    )
    assert not report.untested_musts
    assert not report.unknown_citations
    assert not report.not_literal
    duplicated = _synthetic(tmp_path, SYNTHETIC_SPEC + "- **XYZ-001** SHOULD — again.\n", "")
    assert duplicated.duplicates == ["XYZ-001 at xyz.md:8 (first at xyz.md:3)"]


def test_scanner_tells_suite_citations_from_the_projects(tmp_path: Path) -> None:
    """A MUST cited only under ``tests/`` is reported as held by the project's tests alone,
    unless tagged ``(project)``; one the suite cites is not; a ``(project)`` requirement the
    suite cites is reported as wrongly tagged."""
    spec = (
        "- **XYZ-001** MUST — any backend.\n"
        "- **XYZ-002** MUST (project) — pagedkv's own loader.\n"
        "- **XYZ-003** MUST — any backend, only the project tests it.\n"
        "- **XYZ-004** MUST (project) — but the suite cites it.\n"
    )
    cite = "import pytest\n\n@pytest.mark.spec({})\ndef test_x():\n    pass\n"
    (tmp_path / "xyz.md").write_text(spec, encoding="utf-8")
    (tmp_path / "suite.py").write_text(cite.format('"XYZ-001", "XYZ-004"'), encoding="utf-8")
    (tmp_path / "project.py").write_text(
        cite.format('"XYZ-001", "XYZ-002", "XYZ-003"'), encoding="utf-8"
    )
    report = trace(
        [tmp_path / "xyz.md"],
        [
            (tmp_path / "suite.py", SUITE_PREFIX + "suite.py"),
            (tmp_path / "project.py", "tests/project.py"),
        ],
    )
    assert [r.req_id for r in report.requirements.values() if r.project] == ["XYZ-002", "XYZ-004"]
    assert report.suite_cited == {"XYZ-001", "XYZ-004"}
    assert [r.req_id for r in report.project_only_musts] == ["XYZ-003"]
    assert [r.req_id for r in report.project_scoped_in_suite] == ["XYZ-004"]
    assert not report.untested_musts


@pytest.mark.spec("CRT-006")
def test_scanner_counts_what_certify_checks_certify(tmp_path: Path) -> None:
    """A certify check's ``spec_ids`` cite its non-CRT IDs as the suite's; its CRT IDs are
    not citations; a ``spec_ids`` that is not a literal tuple of strings is reported."""
    spec = "- **XYZ-001** MUST — any server.\n- **CRT-001** MUST (project) — certify itself.\n"
    check = (
        "class Check:\n"
        '    spec_ids: tuple[str, ...] = ("CRT-001", "XYZ-001")\n\n'
        "class Other:\n"
        "    spec_ids = IDS\n"
    )
    (tmp_path / "xyz.md").write_text(spec, encoding="utf-8")
    (tmp_path / "check.py").write_text(check, encoding="utf-8")
    report = trace(
        [tmp_path / "xyz.md"], [], [(tmp_path / "check.py", CERTIFY_PREFIX + "check.py")]
    )
    assert [(c.req_id, c.where) for c in report.citations] == [
        ("XYZ-001", CERTIFY_PREFIX + "check.py:2")
    ]
    assert report.suite_cited == {"XYZ-001"}
    assert report.not_literal == [CERTIFY_PREFIX + "check.py:5"]
    assert [r.req_id for r in report.untested_musts] == ["CRT-001"]


@pytest.mark.parametrize(
    "line",
    [
        "- **KVM-001** MUST — x",
        "- **ENG-123** SHOULD — x",
        "- **ENG-124** MUST (project) — x",
    ],
)
def test_requirement_pattern_matches(line: str) -> None:
    """The requirement pattern accepts both levels and any three-letter prefix."""
    assert REQUIREMENT.match(line)


@pytest.mark.parametrize(
    "line",
    [
        "* **KVM-001** MUST — x",
        "- **KVM-01** MUST — x",
        "- KVM-001 MUST — x",
        "- **KVM-001** MAY — x",
        "  - **KVM-001** MUST — x",
    ],
)
def test_requirement_pattern_rejects(line: str) -> None:
    """Lines that are not requirement lines do not define requirements."""
    assert not REQUIREMENT.match(line)


if __name__ == "__main__":  # print where each MUST is held
    split = project_report()
    musts = [r for r in split.requirements.values() if r.level == "MUST"]
    tagged = [r for r in musts if r.project]
    only = split.project_only_musts
    print(f"{len(musts)} MUSTs: {len(tagged)} tagged (project), {len(only)} any backend is held")
    print("to that only the project's tests cite:")
    for r in only:
        print(f"  {r.req_id} ({r.where})")
