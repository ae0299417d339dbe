"""Batch-1 decode on the Qwen3-0.6B shape, against the memory-bandwidth bound (full mode only).

A decode step of one sequence reads every weight once (the tied LM head reads the whole
embedding table), so its speed is bounded by the machine's memory bandwidth:
``bound tokens/s = read bandwidth / weight bytes per token``. The bandwidth is measured in the
same run, with the same threads, and does not depend on the dtype under test: it is the best
read rate of several kernels streaming a large float32 tensor (:mod:`pagedkv.bench.limits`), so
a dtype whose matrix-vector kernel is slower than the memory is not excused by it.

pagedkv v1 (eager, as by default, and with ``compile``: ENG-115) and transformers ``generate``
decode one request each; decode tokens/s counts the tokens after the first over the time from
the first token to the last (prefill excluded; the compiled step's one compilation is paid in
the warm-up). Each repetition measures the bandwidth, then the three systems (in an order that
rotates), so the figures of one repetition share the machine's load of the moment; the ratios
are medians over repetitions of the per-repetition ratios.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from pagedkv.bench.checkpoints import Checkpoint, qwen3_shaped_checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.hf_systems import HfGenerate, load_hf_model
from pagedkv.bench.limits import read_bandwidth
from pagedkv.bench.pagedkv_system import PagedkvSystem, load_runner, make_engine
from pagedkv.bench.requests import BenchRequest, uniform_requests
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import median, ratio, rounded
from pagedkv.bench.system import SystemUnderTest
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.interfaces import Engine

DTYPES = ("float32", "bfloat16")
PROMPT_LEN = 16
NEW_TOKENS = 17
REPETITIONS = 5
NUM_PAGES = 8
#: The goal: batch-1 decode at this fraction of the bandwidth bound, in every dtype.
FRACTION_TARGET = 0.75


def run(ctx: BenchContext) -> WorkloadResult:
    """Decode tokens/s of pagedkv and generate, beside the bound, in each dtype."""
    result = WorkloadResult("decode")
    ctx.log("decode: preparing the Qwen3-0.6B-shaped checkpoint (generated once)")
    checkpoint = qwen3_shaped_checkpoint(ctx.cache_dir)
    result.figures["checkpoint"] = checkpoint.name
    result.figures["prompt_len"] = PROMPT_LEN
    result.figures["new_tokens"] = NEW_TOKENS
    result.figures["repetitions"] = REPETITIONS
    for dtype in DTYPES:
        try:
            _measure_dtype(ctx, result, checkpoint, dtype)
        except Exception as exc:  # recorded: one dtype failing must not lose the others
            result.errors[dtype] = f"{type(exc).__name__}: {exc}"
        gc.collect()
    return result


def _measure_dtype(
    ctx: BenchContext, result: WorkloadResult, checkpoint: Checkpoint, dtype: str
) -> None:
    short = "fp32" if dtype == "float32" else "bf16"
    ctx.log(f"decode: {dtype}: loading the models (pagedkv eager and compiled, transformers)")
    runners = {
        "pagedkv": load_runner(checkpoint, NUM_PAGES, dtype=dtype, device=ctx.device),
        "compiled": load_runner(
            checkpoint,
            NUM_PAGES,
            dtype=dtype,
            device=ctx.device,
            options=RunnerOptions(compile=True),
        ),
    }
    weight_bytes = runners["pagedkv"].weight_bytes
    hf_model = load_hf_model(checkpoint, dtype, ctx.device)
    request = uniform_requests(1, PROMPT_LEN, NEW_TOKENS, runners["pagedkv"].vocab_size, ctx.seed)
    warm = [BenchRequest(request[0].prompt, 3)]
    measured: dict[str, SystemUnderTest] = {
        name: PagedkvSystem(name, _fresh_engine(runner)) for name, runner in runners.items()
    }
    measured["hf"] = HfGenerate(hf_model, batch_size=1)
    for name, warming in measured.items():  # the compiled step compiles here
        ctx.log(f"decode: {dtype}: warming up {name}")
        warming.run(warm)
    systems = ("pagedkv", "compiled", "hf")
    rates: dict[str, list[float]] = {system: [] for system in systems}
    bounds: list[float] = []
    kernels: list[dict[str, float]] = []
    for repetition in range(REPETITIONS):
        ctx.log(f"decode: {dtype}: repetition {repetition + 1}/{REPETITIONS}")
        bandwidth = read_bandwidth(device=ctx.device)
        kernels.append({k: round(v / 1e9, 2) for k, v in bandwidth.kernels.items()})
        bounds.append(bandwidth.best / weight_bytes)
        turn = repetition % len(systems)
        for system in systems[turn:] + systems[:turn]:
            rates[system].append(measured[system].run(request).decode_tokens_per_s)
    del runners, hf_model, measured
    pagedkv, compiled, hf = (rates[system] for system in systems)

    def per_repetition(numerators: list[float], denominators: list[float]) -> float:
        """The median over repetitions of each repetition's ratio."""
        return median([ratio(n, d) for n, d in zip(numerators, denominators, strict=True)])

    result.figures[dtype] = {
        "weight_bytes_per_token": weight_bytes,
        "read_bandwidth_gb_per_s": [round(b * weight_bytes / 1e9, 2) for b in bounds],
        "read_kernels_gb_per_s": kernels,
        "bound_tokens_per_s": [round(b, 3) for b in bounds],
        "pagedkv_decode_tokens_per_s": [round(r, 3) for r in pagedkv],
        "pagedkv_compiled_decode_tokens_per_s": [round(r, 3) for r in compiled],
        "hf_generate_decode_tokens_per_s": [round(r, 3) for r in hf],
        "median_pagedkv_decode_tokens_per_s": rounded(median(pagedkv), 3),
        "median_pagedkv_compiled_decode_tokens_per_s": rounded(median(compiled), 3),
        "median_hf_generate_decode_tokens_per_s": rounded(median(hf), 3),
        "median_bound_tokens_per_s": rounded(median(bounds), 3),
    }
    result.add_ratio(
        f"{short}_pagedkv_vs_hf_generate",
        per_repetition(pagedkv, hf),
        f"{dtype} batch-1 decode tokens/s, pagedkv over transformers generate (0.6B shape), "
        "median over interleaved repetitions",
    )
    result.add_target(
        f"{short}_pagedkv_vs_hf_generate",
        ">=",
        1.0,
        f"batch-1 decode {short}: pagedkv >= 1.0x transformers generate",
    )
    bound_goal = f"pagedkv >= {FRACTION_TARGET:.0%} of the dtype-free memory-bandwidth bound"
    result.add_ratio(
        f"{short}_fraction_of_bound",
        per_repetition(pagedkv, bounds),
        f"{dtype} batch-1 decode tokens/s of pagedkv over the bandwidth bound (the best "
        "float32 read rate of GEMVs through MKL and oneDNN, a sum and a copy / weight bytes per "
        "token, measured beside each repetition, the same for every dtype)",
    )
    result.add_target(
        f"{short}_fraction_of_bound", ">=", FRACTION_TARGET, f"batch-1 decode {short}: {bound_goal}"
    )
    result.add_ratio(
        f"{short}_hf_fraction_of_bound",
        per_repetition(hf, bounds),
        f"{dtype} batch-1 decode tokens/s of transformers generate over the bandwidth bound",
    )
    result.add_ratio(
        f"{short}_compiled_fraction_of_bound",
        per_repetition(compiled, bounds),
        f"{dtype} batch-1 decode tokens/s of pagedkv with compile (ENG-115) over the same "
        "bandwidth bound",
    )
    result.add_target(
        f"{short}_compiled_fraction_of_bound",
        ">=",
        FRACTION_TARGET,
        f"batch-1 decode {short}, compiled: {bound_goal}",
    )
    result.add_ratio(
        f"{short}_compiled_vs_eager",
        per_repetition(compiled, pagedkv),
        f"{dtype} batch-1 decode tokens/s of pagedkv with compile over pagedkv eager",
    )


def _fresh_engine(runner: ModelRunner) -> Callable[[], Engine]:
    """Builds a fresh v1 engine over ``runner`` for each run."""
    return lambda: make_engine(runner, "v1", NUM_PAGES)
