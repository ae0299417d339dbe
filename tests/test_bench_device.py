"""The bench's device workload on the CPU at its tiny sizes: the memory bound's arithmetic, the
time budget's shares, every row computed and written, and cuts where the budget runs out."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from pagedkv.bench import cli, device, device_rows
from pagedkv.bench.bound import (
    ModelBytes,
    Span,
    context_positions,
    copy_rate,
    fraction_of_bound,
    min_steps,
    read_bytes,
)
from pagedkv.bench.budget import Share, split
from pagedkv.bench.checkpoints import tiny_checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.device_sizes import GPU_SIZES, TINY_SIZES, nanovllm_requests
from pagedkv.bench.results import WorkloadResult
from pagedkv.errors import InvalidRequest


@pytest.mark.spec("ENG-207")
def test_the_bound_counts_weights_per_step_and_every_context() -> None:
    """Known numbers: two requests (context 10, 3 tokens; context 4, 5 tokens), two sequences a
    step: 5 steps (the longest), K/V positions 3*10 + 3 + 5*4 + 10 = 63. Kills a bound that
    reads the weights once per token or per request, forgets the tokens before each one, or
    counts the step from the shortest request."""
    model = ModelBytes.of(1000, layers=2, kv_heads=3, head_dim=4, itemsize=2)
    assert model.kv_bytes_per_position == 2 * 2 * 3 * 4 * 2 == 96
    spans = [Span(10, 3), Span(4, 5)]
    assert min_steps(spans, 2) == 5
    assert min_steps(spans, 1) == 8  # one sequence a step: one step per token
    assert context_positions(spans) == 63
    assert read_bytes(spans, model, 2) == 5 * 1000 + 63 * 96
    # A device copy of 1 GB in 0.5 s moved 4 GB/s: it reads and writes every byte.
    rate = copy_rate(10**9, 0.5)
    assert rate == 4e9
    # 8 GB at 4 GB/s is 2 s; a system that took 4 s ran at half the bound.
    assert fraction_of_bound(8 * 10**9, rate, 4.0) == 0.5
    assert math.isnan(fraction_of_bound(1, rate, 0.0))
    with pytest.raises(InvalidRequest, match="max_batch"):
        min_steps(spans, 0)


@pytest.mark.spec("ENG-209")
def test_shares_are_cumulative_and_end_at_the_deadline() -> None:
    """Shares of weights 1, 3 from 100 to 200 end at 125 and 200: a part that finishes early
    leaves its time to the next. Kills shares that restart from each part's own start (the
    last part would run past the deadline) or ignore the weights."""
    shares = split([("a", 1.0), ("b", 3.0)], 100.0, 200.0)
    assert shares["a"].deadline == 125.0
    assert shares["b"].deadline == 200.0
    assert shares["a"].left(now=120.0) == 5.0
    assert shares["a"].spent(now=125.0)
    assert not shares["b"].spent(now=125.0)
    unbounded = split([("a", 1.0)], 100.0, None)["a"]
    assert unbounded.left() == math.inf
    assert not unbounded.spent()
    with pytest.raises(InvalidRequest, match="weight"):
        split([("a", 0.0)], 0.0, 1.0)


def test_nanovllm_workload_is_drawn_as_its_bench_draws_it() -> None:
    """nano-vllm's bench.py draws, with random.seed(0), every prompt (length, then ids) before
    every output length. Kills interleaved draws or another seed, which give other lengths."""
    import random

    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)
    ]
    outputs = [random.randint(100, 1024) for _ in range(256)]
    ours = nanovllm_requests(256, 100, 1024, vocab=151936, seed=0)
    assert [list(r.prompt) for r in ours] == prompts
    assert [r.max_tokens for r in ours] == outputs
    assert GPU_SIZES.nano_seqs == 256
    assert (GPU_SIZES.nano_low, GPU_SIZES.nano_high) == (100, 1024)
    assert GPU_SIZES.decode_tokens == 256
    assert GPU_SIZES.batches == (8, 32)


@pytest.mark.spec("ENG-208", "ENG-207")
def test_every_row_is_measured_printed_and_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pagedkv bench --quick --only device` on the CPU: every row of every part, each system's
    tokens/s and fraction of the bound, in the log and in results.json. Kills a part that
    is skipped, a row left out of the results, or a fraction missing or out of (0, 1]."""
    out = tmp_path / "out"
    status = cli.main(
        ["--quick", "--only", "device", "--threads", "1", "--out", str(out)]
        + ["--cache-dir", str(tmp_path / "cache")]
    )
    assert status == 0
    document = json.loads((out / "results.json").read_text(encoding="utf-8"))
    workload = document["workloads"]["device"]
    assert workload["errors"] == {}
    assert workload["notes"] == []
    rows = workload["figures"]["rows"]
    assert set(rows) == {
        "decode_bf16",
        "decode_fp32",
        "bf16_bs2",
        "bf16_bs4",
        "fp32_bs2",
        "fp32_bs4",
        "mixed_bf16",
        "nanovllm_bf16",
    }
    assert set(rows["decode_bf16"]) == {"pagedkv", "hf-generate"}
    assert set(rows["mixed_bf16"]) == {"pagedkv", "hf-generate-batch"}
    for row, systems in rows.items():
        for system, figures in systems.items():
            assert figures["tokens_per_s"] > 0, (row, system)
            assert 0 < figures["fraction_of_bound"] <= 1, (row, system)
            key = f"device.{row}_{system}_fraction_of_bound"
            assert document["ratios"][key] == pytest.approx(figures["fraction_of_bound"], abs=1e-3)
    assert document["ratios"]["device.bf16_bs4_pagedkv_vs_hf-generate"] is not None
    for target in device.TARGETS:  # the GPU run's goals name ratios the rows make
        assert f"device.{target[0].replace('bs32', 'bs4')}" in document["ratios"]
    made = workload["figures"]["nanovllm"]
    assert made["output_tokens_made"] == made["output_tokens_asked"]
    log = capsys.readouterr().err
    assert "device: decode_bf16: pagedkv:" in log
    assert "of the memory bound" in log
    assert "device" in (out / "results.md").read_text(encoding="utf-8")


def _spent_after(name: str, checks: int) -> Share:
    """A share spent after ``checks`` checks (its clock made to run out step by step)."""
    left = [checks]

    class SpentAfter:
        def spent(self, now: float | None = None) -> bool:
            left[0] -= 1
            return left[0] < 0

    share = SpentAfter()
    setattr(share, "name", name)  # noqa: B010
    return share  # type: ignore[return-value]


@pytest.mark.spec("ENG-209")
def test_a_spent_share_cuts_nanovllm_between_steps(tmp_path: Path) -> None:
    """nano-vllm's run cut after 3 steps: the tokens made so far count, every request is
    aborted (none left running), and the cut is noted. Kills a cut that loses what was
    measured, that leaves requests in the engine, or that goes unsaid."""
    ctx = BenchContext(quick=True, threads=1, cache_dir=tmp_path, verbose=False)
    result = WorkloadResult("device")
    sizes = dataclasses.replace(TINY_SIZES, nano_high=20)
    part = device_rows.Part(
        ctx,
        sizes,
        _spent_after("nanovllm", 3),
        tiny_checkpoint(tmp_path),
        result,
        device_rows.runner_variants("cpu"),
    )
    device_rows.nanovllm_part(part)
    made = result.figures["nanovllm"]
    assert result.figures["nanovllm_steps"] == 3
    assert 0 < made["output_tokens_made"] < made["output_tokens_asked"]
    assert result.figures["rows"]["nanovllm_bf16"]["pagedkv"]["tokens_per_s"] > 0
    assert result.notes
    assert result.notes[0].startswith("cut: nanovllm spent its share")


@pytest.mark.spec("ENG-209")
def test_a_spent_budget_starts_no_part_and_says_so(tmp_path: Path) -> None:
    """A run whose budget is already spent measures nothing and notes every part as cut; a
    budget that is not positive is refused. Kills a budget the parts ignore."""
    ctx = BenchContext(
        quick=True, threads=1, cache_dir=tmp_path, verbose=False, deadline=time.perf_counter()
    )
    result = device.run(ctx)
    assert "rows" not in result.figures
    assert [n.split(" spent")[0] for n in result.notes] == [
        f"cut: {name}" for name, _, _ in device.PARTS
    ]
    assert cli.main(["--budget-s", "0", "--out", str(tmp_path)]) == 2


@pytest.mark.spec("ENG-209")
def test_a_workload_in_its_own_process_keeps_the_time_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full run measures each workload in a fresh process, which is told the seconds left
    (--seconds-left) and sets its own deadline from them; a workload that would start after
    the budget is not started, and says so. Kills a budget lost on the way to the child (its
    parts would then run unbounded) and a suite that starts workloads past it."""
    from pagedkv.bench import isolated, suite
    from pagedkv.bench.workloads import Workload, WorkloadTable

    seen: list[float | None] = []

    def probe() -> object:
        def run(ctx: BenchContext, checkpoint: object, vocab: int) -> WorkloadResult:
            seen.append(None if ctx.deadline is None else ctx.deadline - time.perf_counter())
            return WorkloadResult("probe")

        return run

    table = WorkloadTable((Workload("probe", probe),), child_module="unused")  # type: ignore[arg-type]
    monkeypatch.setattr(isolated, "small_checkpoint", lambda cache: tiny_checkpoint(tmp_path))
    result_file = tmp_path / "result.json"
    args = ["probe", str(result_file), "--threads", "1", "--cache-dir", str(tmp_path)]
    assert isolated.main([*args, "--seconds-left", "50", "--quiet"], table) == 0
    assert isolated.main([*args, "--quiet"], table) == 0
    assert seen[0] is not None
    assert 40 < seen[0] <= 50
    assert seen[1] is None
    spent = BenchContext(
        quick=True, threads=1, cache_dir=tmp_path, verbose=False, deadline=time.perf_counter()
    )
    skipped = suite._run_one(table, "probe", spent, tiny_checkpoint(tmp_path), 256)
    assert skipped.notes == ["cut: probe not started: the run's time budget was spent"]
    assert len(seen) == 2


@pytest.mark.spec("ENG-230")
def test_the_triton_variant_is_timed_on_cuda_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA device with triton installed both variants are timed, the Triton one with
    both Triton options; on the CPU, or without triton, the defaults alone. Kills a device run
    that never times the Triton kernels, or a CPU run that times the interpreter."""
    from pagedkv.engine.runner_options import RunnerOptions

    monkeypatch.setattr(device_rows.importlib.util, "find_spec", lambda name: object())
    on_cuda = device_rows.runner_variants("cuda:0")
    assert on_cuda == {
        "pagedkv": RunnerOptions(),
        "pagedkv-triton": RunnerOptions(attention="triton", fused_ops="triton"),
    }
    assert device_rows.runner_variants("cpu") == {"pagedkv": RunnerOptions()}
    monkeypatch.setattr(device_rows.importlib.util, "find_spec", lambda name: None)
    assert device_rows.runner_variants("cuda") == {"pagedkv": RunnerOptions()}


@pytest.mark.spec("ENG-231")
def test_a_full_cpu_run_measures_the_device_workload_only_when_named(tmp_path: Path) -> None:
    """Without ``--only``: a full CPU run measures every workload but ``device`` (the
    project's table, with its peers, too); ``--device cuda`` keeps it; ``--quick`` keeps its
    own. Kills a full CPU run that starts the GPU-sized workload unasked (nano-vllm's 256
    sequences on a CPU: hours)."""
    from pagedkv.bench.suite import default_selection
    from pagedkv.bench.workloads import PAGEDKV_WORKLOADS
    from pagedkv_bench.workloads import PROJECT_WORKLOADS

    def context(**kwargs: Any) -> BenchContext:
        return BenchContext(threads=1, cache_dir=tmp_path, verbose=False, **kwargs)

    for table in (PAGEDKV_WORKLOADS, PROJECT_WORKLOADS):
        on_cpu = default_selection(table, context(quick=False))
        assert "device" not in on_cpu
        assert set(on_cpu) == set(table.names) - {"device"}
        assert "device" in default_selection(table, context(quick=False, device="cuda"))
        assert default_selection(table, context(quick=True)) == table.quick_names
    assert "peers" in default_selection(PROJECT_WORKLOADS, context(quick=False))
