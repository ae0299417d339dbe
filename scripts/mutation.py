"""Mutation testing of the reference: ``make mutation`` (mutmut 3, one run per package).

Each package is mutated on its own, in its own folder ``build/mutation/<package>/`` (mutmut
copies the sources there and never touches the checkout), with a fast, targeted selection of
tests and a timeout per mutant. For each package it prints the mutation score (killed over
all mutants) and lists the surviving mutants with their diff; a survivor listed in
``conformance/mutation-equivalents.toml`` is shown with the reason it is equivalent, and only
the others count as untriaged.

    python scripts/mutation.py                 # every package but runner
    python scripts/mutation.py runner          # the model runner (slow: compiled decode steps)
    python scripts/mutation.py kv store        # some of them
    python scripts/mutation.py --tests-from DIR  # tests (tests/, conformance/) of another tree
    python scripts/mutation.py kv --rerun-survivors  # only the last run's survivors, current tests

``--tests-from`` runs the same mutants against the tests of another checkout (for example
the main branch), to compare scores before and after a change to the tests.
``--rerun-survivors`` tests again, against the tests as they are now, only the mutants the last
run of a package left alive: new tests can only kill more, so the score it prints is the score
of a full run, in a fraction of its time (the sources must be those of the last run).
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "mutation"
EQUIVALENTS = ROOT / "conformance" / "mutation-equivalents.toml"
#: Each mutant's status after a package's last run, kept in its folder for reruns and reports.
STATUSES = "statuses.json"


@dataclass(frozen=True)
class Package:
    """One mutated package: the files mutmut mutates and the tests that should kill them."""

    name: str
    files: tuple[str, ...]
    tests: tuple[str, ...]


#: The tests of engine/ (sampler, scheduler and the engine itself): mutmut runs, for each
#: mutant, those that call the mutated function. Not here, for time: the engine state machine
#: (30 s a run under the mutation profile), the real-model cases and the server's tests; they
#: check the same engine code as these, through more sequences or through HTTP.
ENGINE_TESTS = (
    "tests/test_scheduler.py",
    "tests/test_scheduler_edges.py",
    "tests/test_parallel_without_fork.py",
    "tests/test_prompt_logprobs.py",
    "tests/test_engine_api.py",
    "tests/test_engine_metrics.py",
    "tests/test_engine_faults.py",
    "tests/test_engine_sampling.py",
    "tests/test_sampler.py",
    "tests/test_sampling_controls.py",
    "tests/test_detokenizer.py",
    "tests/test_detokenizer_edges.py",
    "tests/test_engine_edges.py",
    "tests/test_output_kind.py",
    "tests/test_engine_end.py",
    "tests/test_model_dir_files.py",
    "tests/test_hf_conventions.py",
    "tests/test_vllm_api.py",
    "tests/test_chat_template_kwargs.py",
    "conformance/test_engine.py",
    "conformance/test_engine_text.py",
    "conformance/test_engine_observers.py",
    "conformance/test_engine_isolation.py",
    "conformance/test_engine_parallel.py",
    "conformance/test_engine_sampling.py",
    "conformance/test_engine_salt.py",
)

PACKAGES: dict[str, Package] = {
    p.name: p
    for p in (
        Package(
            "kv",
            (
                "src/pagedkv/kv/manager.py",
                "src/pagedkv/kv/page_pool.py",
                "src/pagedkv/kv/prefix_index.py",
                "src/pagedkv/kv/radix_index.py",
                "src/pagedkv/kv/in_flight.py",
                "src/pagedkv/kv/invariants.py",
            ),
            (
                "tests/test_reference_kv_manager.py",
                "tests/test_radix_index.py",
                "tests/test_in_flight.py",
                "conformance/test_kv_manager.py",
                "conformance/test_kv_match.py",
                "conformance/test_kv_fork.py",
                "conformance/test_kv_state_machine.py",
                "conformance/test_kv_variants.py",
            ),
        ),
        Package(
            "store",
            ("src/pagedkv/store/paged_store.py", "src/pagedkv/store/ragged_attention.py"),
            (
                "tests/test_paged_store.py",
                "tests/test_paged_store_copy.py",
                "tests/test_attention_layout.py",
                "conformance/test_paged_store.py",
            ),
        ),
        Package(
            "sampler",
            ("src/pagedkv/engine/sampler.py", "src/pagedkv/engine/params.py"),
            ENGINE_TESTS,
        ),
        Package(
            "scheduler",
            tuple(
                f"src/pagedkv/engine/{name}.py"
                for name in (
                    "sched/output",
                    "sched/scheduler",
                    "sched/paged",
                    "sched/recompute",
                    "sched/factory",
                    "request",
                    "group",
                )
            ),
            ENGINE_TESTS,
        ),
        Package(
            "engine",
            tuple(
                f"src/pagedkv/engine/{name}.py"
                for name in (
                    "config",
                    "engine",
                    "outputs",
                    "detokenizer",
                    "tokenizer",
                    "prompts",
                    "generation_config",
                    "chat_template",
                    "llm",
                )
            ),
            ENGINE_TESTS,
        ),
        Package(
            "runner",
            tuple(
                f"src/pagedkv/engine/{name}.py"
                for name in ("runner", "runner_options", "static_decode", "host_memory")
            ),
            (
                "tests/test_runner_options.py",
                "tests/test_host_memory.py",
                "conformance/test_engine_model.py",
            ),
        ),
    )
}

#: Tests that cannot run under mutmut: they list a class's methods, and mutmut adds its mutants
#: of every method to the class.
NOT_UNDER_MUTMUT = "not test_test_tokenizers_override_every_public_method"

#: Packages mutated only when named: the runner's tests load checkpoints and compile decode
#: steps (torch.compile), minutes per mutant on 2 cores.
ON_REQUEST = frozenset({"runner"})

#: mutmut's per-mutant timeout is ``multiplier * (duration of the tests covering the mutated
#: function) + constant`` seconds: an infinite loop is cut quickly.
TIMEOUT_MULTIPLIER = 4.0
TIMEOUT_CONSTANT = 10.0

#: How mutmut reports each status in ``mutmut results --all true``.
KILLED = {"killed", "timeout", "caught by type check", "segfault"}
SKIPPED = {"skipped", "not checked"}


def write_config(work: Path, package: Package, tests: list[str]) -> None:
    lines = [
        "[tool.mutmut]",
        'source_paths = ["src/pagedkv"]',
        f"only_mutate = {list(package.files)!r}",
        'also_copy = ["conformance/"]',
        # Error-message text is not behaviour: the suite checks the typed error, not its words.
        'do_not_mutate_patterns = ["raise [A-Za-z_.]+\\\\("]',
        f"pytest_add_cli_args = {['-p', 'no:cacheprovider', '-q', '-x', '-k', NOT_UNDER_MUTMUT]!r}",
        f"pytest_add_cli_args_test_selection = {tests!r}",
        f"timeout_multiplier = {TIMEOUT_MULTIPLIER}",
        f"timeout_constant = {TIMEOUT_CONSTANT}",
        # torch is not fork-safe once its thread pool runs: fork workers from a clean server.
        'process_isolation = "forkserver"',
        "use_git_change_detection = false",
    ]
    (work / "pyproject.toml").write_text("\n".join(lines).replace("'", '"') + "\n")


def prepare(package: Package, tests_root: Path, work: Path) -> tuple[Path, list[str]]:
    """A fresh folder holding links to the sources and the tests; the tests that exist."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / "src").symlink_to(ROOT / "src")
    (work / "tests").symlink_to(tests_root / "tests")
    (work / "conformance").symlink_to(tests_root / "conformance")
    tests = [t for t in package.tests if (work / t.split("::")[0]).exists()]
    write_config(work, package, tests)
    return work, tests


def mutmut(work: Path, *args: str, log: Path | None = None) -> str:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PAGEDKV_HYPOTHESIS_PROFILE="mutation", PYTHONHASHSEED="0")
    env.pop("PAGEDKV_BACKEND", None)
    command = [str(Path(sys.executable).with_name("mutmut")), *args]
    if log is None:
        return subprocess.run(
            command, cwd=work, env=env, capture_output=True, text=True, check=True
        ).stdout
    with log.open("w") as out:
        code = subprocess.run(
            command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
        ).returncode
    if code != 0:
        # mutmut 3 can exit non-zero at shutdown after every mutant was tested; the results
        # read below say whether they were.
        print(f"  (mutmut {' '.join(args)} exited {code}; see {log})")
    return ""


@dataclass(frozen=True)
class Equivalents:
    """Survivors triaged as equivalent: by name, by an argument whose value cannot matter, or
    by a rule matching the mutant's diff."""

    by_name: dict[str, str]
    arguments: list[tuple[str, re.Pattern[str], str]]
    rules: list[tuple[re.Pattern[str], str]]
    #: Mutants a test kills where mutmut cannot see it (in a child process, or in a test kept
    #: out of the selection for its cost): the test, and why mutmut misses it. Counted killed.
    elsewhere: dict[str, tuple[str, str]] = field(default_factory=dict)

    def reason(self, name: str, removed: list[str], added: list[str]) -> str | None:
        if name in self.by_name:
            return self.by_name[name]
        if (
            removed
            and len(removed) == len(added)
            and all(message_only(a, b) for a, b in zip(removed, added, strict=True))
        ):
            return "changes only the text of a message (the suite checks typed errors)"
        before, after = " ".join(removed), " ".join(added)
        for argument, value, reason in self.arguments:
            if before != after and (
                without(before, argument, value) == without(after, argument, value)
            ):
                return reason
        diff = " | ".join(removed + added)
        for pattern, reason in self.rules:
            if pattern.search(diff):
                return reason
        return None


def without(line: str, argument: str, value: re.Pattern[str]) -> str:
    """``line`` with the keyword ``argument`` (given ``value``, or None) taken out, and the
    assignment ``argument = value`` (or None) blanked."""
    values = f"(?:{value.pattern}|None)"
    line = re.sub(rf"\b{argument}={values},?\s*", "", line)
    line = re.sub(rf"^{argument} = {values}$", f"{argument} = _", line.strip())
    return re.sub(r",\s*\)", ")", line)


_STRING = re.compile(r"""f?("([^"\\]|\\.)*"|'([^'\\]|\\.)*')""")


def message_only(removed: str, added: str) -> bool:
    """Whether two lines differ only in the last argument of a call being a string literal (a
    message's text) that became another string or ``None``."""

    def strip(line: str) -> str:
        line = _STRING.sub("MSG", line.strip())
        return re.sub(r"(^|, )None(\)?,?)$", r"\1MSG\2", line)

    normal = strip(removed)
    ends = normal.endswith(("MSG", "MSG)", "MSG,", "MSG),"))
    return removed != added and ends and normal == strip(added)


def load_equivalents() -> Equivalents:
    if not EQUIVALENTS.exists():
        return Equivalents({}, [], [], {})
    data = tomllib.loads(EQUIVALENTS.read_text(encoding="utf-8"))
    by_name = {name: str(e["reason"]) for name, e in data.get("equivalent", {}).items()}
    arguments = [
        (str(a["name"]), re.compile(a["value"]), str(a["reason"])) for a in data.get("argument", [])
    ]
    rules = [(re.compile(r["pattern"]), str(r["reason"])) for r in data.get("rule", [])]
    elsewhere = {
        name: (str(e["test"]), str(e["reason"]))
        for name, e in data.get("killed_elsewhere", {}).items()
    }
    return Equivalents(by_name, arguments, rules, elsewhere)


def _function(lines: list[str], name: str) -> list[str]:
    """The body of ``def <name>(`` in a mutated file (up to the next line indented as little)."""
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(f"def {name}("))
    indent = len(lines[start]) - len(lines[start].lstrip())
    while not lines[start].rstrip().endswith(":"):  # a signature over several lines
        start += 1
    end = start + 1
    while end < len(lines) and (
        not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
    ):
        end += 1
    return [line.strip() for line in lines[start + 1 : end] if line.strip()]


def diff_of(work: Path, name: str) -> tuple[list[str], list[str]]:
    """The lines the mutant ``package.module.function__mutmut_N`` removes and adds, read from
    mutmut's mutated copy (its original and mutated versions of the function)."""
    module, function = name.rsplit(".", 1)
    path = work / "mutants" / "src" / Path(*module.split("."))
    lines = path.with_suffix(".py").read_text(encoding="utf-8").splitlines()
    stem = function.rpartition("__mutmut_")[0]
    original = _function(lines, f"{stem}__mutmut_orig")
    mutated = _function(lines, function)
    removed, added = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=original, b=mutated).get_opcodes():
        if tag != "equal":
            removed += original[i1:i2]
            added += mutated[j1:j2]
    return removed, added


def run_package(
    package: Package,
    tests_root: Path,
    jobs: int,
    equivalents: Equivalents,
    mode: str,
    work: Path,
) -> dict[str, float]:
    tests = list(package.tests)
    started = time.monotonic()
    if mode == "full":
        work, tests = prepare(package, tests_root, work)
        mutmut(work, "run", "--max-children", str(jobs), log=work / "run.log")
        statuses = statuses_of(work)
    elif mode == "rerun":
        # mutmut forgets every result once its configuration changes (the selection may have
        # grown), so the statuses come from the record of the last run, updated with the
        # survivors' new ones: a kill by the old tests is a kill by the new, which keep them.
        statuses = recorded_statuses(work) or statuses_of(work)
        alive = [n for n, s in statuses.items() if s not in KILLED | SKIPPED]
        tests = [t for t in package.tests if (work / t.split("::")[0]).exists()]
        write_config(work, package, tests)  # the package's selection as it is now
        if alive:
            mutmut(work, "run", "--max-children", str(jobs), *alive, log=work / "rerun.log")
            now = statuses_of(work)
            statuses.update({n: now[n] for n in alive if n in now})
    else:
        statuses = recorded_statuses(work) or statuses_of(work)
    (work / STATUSES).write_text(json.dumps(statuses, indent=0, sort_keys=True))
    elapsed = time.monotonic() - started
    counted = {n: s for n, s in statuses.items() if s not in SKIPPED}
    for name, (test, why) in equivalents.elsewhere.items():
        # Only where the killing test is among the tests run (not in an older tree's).
        if counted.get(name) not in (None, *KILLED) and (work / test.split("::")[0]).exists():
            counted[name] = "killed"
            print(f"  {name}: killed by {test}, outside mutmut: {why}")
    killed = sum(1 for s in counted.values() if s in KILLED)
    survivors = sorted(n for n, s in counted.items() if s not in KILLED)
    score = killed / len(counted) if counted else 0.0
    print(
        f"\n== {package.name}: {killed}/{len(counted)} killed, score {score:.1%} "
        f"({elapsed:.0f} s; tests: {', '.join(tests)})"
    )
    untriaged = 0
    for name in survivors:
        removed, added = diff_of(work, name)
        reason = equivalents.reason(name, removed, added)
        if reason is None:
            untriaged += 1
        tag = f"equivalent: {reason}" if reason else "UNTRIAGED"
        change = " | ".join([*(f"-{r}" for r in removed), *(f"+{a}" for a in added)])
        print(f"  {counted[name]:>9}  {name}")
        print(f"             {change[:220]}\n             [{tag}]")
    equivalent = len(survivors) - untriaged
    print(f"   {len(survivors)} survivors: {equivalent} equivalent, {untriaged} untriaged")
    # An entry naming a mutant that no longer survives is stale: mutmut numbers mutants per
    # function, so after an edit the name may belong to another mutant, which a later run
    # would call equivalent for a reason written about a different change.
    modules = tuple(
        f.removeprefix("src/").removesuffix(".py").replace("/", ".") + "." for f in package.files
    )
    stale = sorted(n for n in equivalents.by_name if n.startswith(modules) and n not in survivors)
    for name in stale:
        print(f"  STALE equivalent entry (not a survivor of this run): {name}")
    return {
        "score": score,
        "killed": killed,
        "total": len(counted),
        "equivalent": equivalent,
        "untriaged": untriaged,
        "seconds": elapsed,
    }


def recorded_statuses(work: Path) -> dict[str, str]:
    """The statuses the last run in ``work`` recorded (empty before any run)."""
    path = work / STATUSES
    if not path.exists():
        return {}
    loaded: dict[str, str] = json.loads(path.read_text())
    return loaded


def statuses_of(work: Path) -> dict[str, str]:
    """mutmut's status of every mutant of the last run in ``work``, by mutant name."""
    statuses: dict[str, str] = {}
    for line in mutmut(work, "results", "--all", "true").splitlines():
        match = re.match(r"\s*(\S+): (.+)$", line)
        if match:
            statuses[match.group(1)] = match.group(2).strip()
    return statuses


def restrict(package: Package, pattern: str | None) -> Package:
    """``package`` with only the files matching ``pattern`` (all of them for ``None``)."""
    if pattern is None:
        return package
    files = tuple(f for f in package.files if fnmatch.fnmatch(f, pattern))
    return Package(package.name, files, package.tests)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", choices=[*PACKAGES, []], default=[])
    parser.add_argument(
        "--tests-from", type=Path, default=ROOT, help="tree whose tests/ and conformance/ run"
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--report-only", action="store_true", help="report the last run's results again"
    )
    parser.add_argument(
        "--rerun-survivors",
        action="store_true",
        help="test again only the last run's survivors, against the current tests",
    )
    parser.add_argument(
        "--build", type=Path, default=BUILD, help=f"where the runs happen (default {BUILD})"
    )
    parser.add_argument(
        "--only", metavar="GLOB", help="mutate only the package files matching GLOB"
    )
    args = parser.parse_args()
    names = args.packages or [name for name in PACKAGES if name not in ON_REQUEST]
    equivalents = load_equivalents()
    started = time.monotonic()
    results = {
        name: run_package(
            restrict(PACKAGES[name], args.only),
            args.tests_from.resolve(),
            args.jobs,
            equivalents,
            "report" if args.report_only else "rerun" if args.rerun_survivors else "full",
            args.build.resolve() / name,
        )
        for name in names
    }
    print("\nmutation score per package")
    for name, r in results.items():
        beyond = max(1, r["total"] - r["equivalent"])
        print(
            f"  {name:8} {r['killed']:>4}/{r['total']:<4} {r['score']:.1%}; "
            f"{r['killed'] / beyond:.1%} of the {beyond} not equivalent; "
            f"untriaged survivors {r['untriaged']}  ({r['seconds']:.0f} s)"
        )
    print(f"  total time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
