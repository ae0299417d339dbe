"""A full benchmark run takes each workload's result from a fresh process (SRV-049)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from pagedkv.bench import cli, isolated, suite
from pagedkv.bench.context import BenchContext
from pagedkv.bench.results import Target, WorkloadResult


@pytest.mark.spec("SRV-049")
def test_a_full_run_takes_each_workload_from_its_own_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    commands: list[list[str]] = []
    real_run = subprocess.run

    def recording_run(command: list[str], **kwargs: Any) -> Any:
        commands.append(list(command))
        return real_run(command, **kwargs)

    monkeypatch.setattr(isolated.subprocess, "run", recording_run)
    out = tmp_path / "out"
    argv = ["--only", "parallel", "--out", str(out), "--no-plots", "--quiet"]
    assert cli.main([*argv, "--cache-dir", str(tmp_path / "cache")]) == 0
    children = [c[:4] for c in commands if "pagedkv.bench.isolated" in c]
    assert children == [[sys.executable, "-m", "pagedkv.bench.isolated", "parallel"]]
    document = json.loads((out / "results.json").read_text())
    parallel = [k for k in document["ratios"] if k.startswith("parallel.")]
    assert parallel
    assert all(document["ratios"][k] is not None for k in parallel)


@pytest.mark.spec("SRV-049")
def test_a_workload_whose_process_fails_is_an_error_of_that_workload(tmp_path: Path) -> None:
    """Zero threads: the child process dies before it runs the workload."""
    ctx = BenchContext(quick=False, threads=0, cache_dir=tmp_path, verbose=False)
    result = isolated.run_isolated("parallel", ctx)
    assert result.name == "parallel"
    assert "exited with status 1" in result.errors["workload"]
    assert not result.ratios


@pytest.mark.spec("SRV-049")
def test_a_failed_workload_fails_the_run_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asked: list[str] = []

    def fake_isolated(name: str, ctx: BenchContext, child_module: str) -> WorkloadResult:
        asked.append(name)
        if name == "detokenize":
            return WorkloadResult(name, errors={"workload": "its process exited with status 1"})
        result = WorkloadResult(name)
        result.add_ratio("x", 1.0, "d")
        return result

    monkeypatch.setattr(suite, "run_isolated", fake_isolated)
    out = tmp_path / "out"
    argv = ["--only", "detokenize", "--only", "parallel", "--out", str(out), "--no-plots"]
    assert cli.main([*argv, "--quiet", "--cache-dir", str(tmp_path / "cache")]) == 1
    assert asked == ["detokenize", "parallel"]
    document = json.loads((out / "results.json").read_text())
    assert document["ratios"]["parallel.x"] == 1.0


def test_a_result_survives_its_trip_through_json() -> None:
    result = WorkloadResult("w", figures={"a": [1, 2]}, notes=["n"], errors={"x": "y"})
    result.add_ratio("r", float("nan"), "d")
    result.add_target("r", ">=", 2.0, "goal")
    result.seconds = 1.5
    back = isolated.result_from_json(json.loads(json.dumps(asdict(result))))
    assert back.targets == [Target("w.r", ">=", 2.0, "goal")]
    assert (back.figures, back.notes, back.errors, back.seconds) == (
        {"a": [1, 2]},
        ["n"],
        {"x": "y"},
        1.5,
    )
    assert back.descriptions == {"w.r": "d"}
    assert math.isnan(back.ratios["w.r"])
