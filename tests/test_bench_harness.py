"""The project's benchmark harness (bench/pagedkv_bench) extends the installed ``pagedkv
bench`` and is never imported by it: the same workloads, the peers workload added, the gate
on its command line only."""

from __future__ import annotations

import ast
from pathlib import Path

from pagedkv.bench import cli
from pagedkv.bench.workloads import PAGEDKV_WORKLOADS
from pagedkv_bench import cli as project_cli
from pagedkv_bench.workloads import PROJECT_WORKLOADS

SRC = Path(__file__).resolve().parents[1] / "src"


def test_the_project_runs_pagedkv_benchs_workloads_and_the_peers_after_parallel() -> None:
    names = list(PAGEDKV_WORKLOADS.names)
    names.insert(names.index("parallel") + 1, "peers")
    assert PROJECT_WORKLOADS.names == tuple(names)
    assert PROJECT_WORKLOADS.quick_names == PAGEDKV_WORKLOADS.quick_names
    assert PROJECT_WORKLOADS.cuda_names == ("decode", "device", "peers")
    assert PROJECT_WORKLOADS.child_module == "pagedkv_bench.isolated"
    assert "peers" not in PAGEDKV_WORKLOADS.names


def test_the_gate_is_the_projects_option_only() -> None:
    assert project_cli.build_parser().parse_args(["--gate", "f.json"]).gate == Path("f.json")
    assert "gate" not in vars(cli.build_parser().parse_args([]))


def test_nothing_installed_imports_the_harness() -> None:
    importers = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module]
            if any(n.partition(".")[0] == "pagedkv_bench" for n in names):
                importers.append(str(path.relative_to(SRC)))
    assert importers == []
