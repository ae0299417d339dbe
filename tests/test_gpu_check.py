"""The prepared device check, scripts/gpu_check.sh: its list of CUDA tests, and its parts, limits
and reports, run on the CPU (the tests' interpreter slowed on purpose where a cut is wanted)."""

from __future__ import annotations

import ast
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TEST_LIST = ROOT / "scripts" / "gpu_check_tests.txt"
#: Tests that mention CUDA and skip, but run where CUDA is absent (so not on the GPU).
RUN_WITHOUT_CUDA = {
    "tests/test_bench_limits.py::test_cuda_is_skipped_with_a_reason_without_a_gpu",
    "tests/test_triton_kernels.py::test_the_tests_run_the_kernels_under_the_interpreter",
    "tests/test_triton_option.py::test_triton_on_a_cpu_pool_without_the_interpreter_is_refused",
    "tests/test_triton_fused_option.py::test_triton_on_a_cpu_model_without_the_interpreter_is_refused",
}


def listed() -> list[str]:
    lines = TEST_LIST.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _cuda_markers(tree: ast.Module, source: str) -> set[str]:
    """Module-level names bound to a skip mark that depends on CUDA."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            text = ast.get_source_segment(source, node) or ""
            if "skip" in text and "cuda.is_available" in text:
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def cuda_gated(path: Path, root: Path = ROOT) -> set[str]:
    """``file::function`` of every test in ``path`` skipped without CUDA: a skip (decorator or
    call) beside ``cuda.is_available``, or a module-level CUDA skip mark, in its source."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    markers = _cuda_markers(tree, source)
    module_skip = "pytestmark" in markers
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
            continue
        text = "\n".join(ast.unparse(d) for d in node.decorator_list) + ast.unparse(node)
        gated = ("skip" in text and "cuda.is_available" in text) or any(
            re.search(rf"\b{name}\b", text) for name in markers
        )
        if gated or module_skip:
            found.add(f"{path.relative_to(root)}::{node.name}")
    return found


@pytest.mark.spec("GLD-060")
def test_the_script_runs_every_test_skipped_without_cuda() -> None:
    """Every test of tests/ skipped without CUDA is in the script's list, every listed test
    exists, and every conformance test skipped without CUDA has "cuda" in its name (-k cuda
    selects it). Kills a CUDA test added later that the device check would never run, and a
    listed test renamed away (pytest would fail the part on a missing node)."""
    gated: set[str] = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        gated |= cuda_gated(path)
    gated -= RUN_WITHOUT_CUDA
    named = {node.split("[")[0] for node in listed()}
    assert gated == named
    for path in sorted((ROOT / "conformance").glob("suite_*.py")):
        for test in cuda_gated(path):
            assert "cuda" in test.split("::")[1], test


def test_the_scan_finds_each_way_a_test_is_gated(tmp_path: Path) -> None:
    """The scan sees a skipif decorator, a pytest.skip call, and a parametrized CUDA mark, and
    not a test that only mentions CUDA. Kills a scan that finds nothing (the list check would
    then pass with an empty list)."""
    sample = tmp_path / "sample.py"
    available = "cuda." + "is_available"  # not in this test's own source, which is scanned
    sample.write_text(
        "import pytest, torch\n"
        f"CUDA = pytest.mark.skipif(not torch.{available}(), reason='x')\n"
        f"@pytest.mark.skipif(not torch.{available}(), reason='x')\n"
        "def test_a(): pass\n"
        "def test_b():\n"
        f"    if not torch.{available}():\n"
        "        pytest.skip('x')\n"
        "@pytest.mark.parametrize('d', ['cpu', pytest.param('cuda', marks=CUDA)])\n"
        "def test_c(d): pass\n"
        "def test_d():\n"
        f"    assert torch.{available}() in (True, False)\n",
        encoding="utf-8",
    )
    found = {t.split("::")[1] for t in cuda_gated(sample, tmp_path)}
    assert found == {"test_a", "test_b", "test_c"}


def _slow_python(folder: Path) -> Path:
    """An interpreter that runs pytest slowly (5 s asleep first) and everything else as the
    tests' own Python does."""
    shim = folder / "python"
    shim.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then sleep 5; fi\n'
        f'exec "{sys.executable}" "$@"\n',
        encoding="utf-8",
    )
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return shim


@pytest.mark.spec("GLD-059")
def test_each_part_runs_under_its_limit_and_reports(tmp_path: Path) -> None:
    """With the test parts slower than their limits: both are cut and say so, the bench still
    runs and writes its results, everything lands in OUT, and the exit status is 1. Kills a
    script whose first slow part takes the whole time, that reports a cut part as passed, or
    that loses the bench's results."""
    out = tmp_path / "out"
    env = dict(
        os.environ,
        PYTHON=str(_slow_python(tmp_path)),
        GPU_CHECK_TESTS_S="1",
        GPU_CHECK_CONFORMANCE_S="1",
        GPU_CHECK_BENCH_S="1",
        PAGEDKV_BENCH_CACHE=str(tmp_path / "cache"),
    )
    done = subprocess.run(
        ["bash", str(SCRIPT), "--tiny", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text(encoding="utf-8").splitlines()
    assert [line.split(":")[0] for line in summary] == ["tests", "conformance", "bench"]
    assert summary[0].startswith("tests: CUT: reached its 1 s limit")
    assert summary[1].startswith("conformance: CUT: reached its 1 s limit")
    assert summary[2].startswith("bench: passed")
    document = json.loads((out / "bench" / "results.json").read_text(encoding="utf-8"))
    notes = document["workloads"]["device"]["notes"]
    assert notes
    assert all(note.startswith("cut: ") for note in notes)
    log = (out / "gpu_check.log").read_text(encoding="utf-8")
    assert "gpu-check: tests: CUT" in log
    assert "gpu-check: bench: passed" in log


@pytest.mark.spec("GLD-059")
def test_a_malformed_command_line_is_refused() -> None:
    """No OUT folder: usage on stderr and status 2. Kills a script that writes somewhere
    unasked."""
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 2
    assert "usage: scripts/gpu_check.sh" in done.stderr
