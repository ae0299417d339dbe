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

from pagedkv.bench.checkpoints import Checkpoint, qwen3_shaped_checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.hf_systems import load_hf_model, run_generate_static
from pagedkv.bench.limits import read_bandwidth
from pagedkv.bench.pagedkv_system import load_runner, make_engine, run_engine
from pagedkv.bench.requests import BenchRequest, uniform_requests
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.stats import median, ratio, rounded
from pagedkv.engine.runner_options import RunnerOptions

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
    ctx.log(f"decode: {dtype}: loading both models")
    runner = load_runner(checkpoint, NUM_PAGES, dtype=dtype, device=ctx.device)
    compiled = load_runner(
        checkpoint, NUM_PAGES, dtype=dtype, device=ctx.device, options=RunnerOptions(compile=True)
    )
    weight_bytes = runner.weight_bytes
    hf_model = load_hf_model(checkpoint, dtype, ctx.device)
    vocab = runner.vocab_size
    request = uniform_requests(1, PROMPT_LEN, NEW_TOKENS, vocab, ctx.seed)
    warm = [BenchRequest(request[0].prompt, 3)]
    run_engine(make_engine(runner, "v1", NUM_PAGES), warm, "warm-up")
    ctx.log(f"decode: {dtype}: compiling the decode step")
    run_engine(make_engine(compiled, "v1", NUM_PAGES), warm, "warm-up")
    run_generate_static(hf_model, warm, batch_size=1)
    pagedkv_rates: list[float] = []
    compiled_rates: list[float] = []
    hf_rates: list[float] = []
    bounds: list[float] = []
    kernels: list[dict[str, float]] = []
    for repetition in range(REPETITIONS):
        ctx.log(f"decode: {dtype}: repetition {repetition + 1}/{REPETITIONS}")
        bandwidth = read_bandwidth(device=ctx.device)
        kernels.append({k: round(v / 1e9, 2) for k, v in bandwidth.kernels.items()})
        bounds.append(bandwidth.best / weight_bytes)
        systems = ("pagedkv", "compiled", "hf")
        for system in systems[repetition % 3 :] + systems[: repetition % 3]:
            if system == "hf":
                hf_rates.append(run_generate_static(hf_model, request, 1).decode_tokens_per_s)
            else:
                engine = make_engine(runner if system == "pagedkv" else compiled, "v1", NUM_PAGES)
                rate = run_engine(engine, request, system).decode_tokens_per_s
                (pagedkv_rates if system == "pagedkv" else compiled_rates).append(rate)
    del runner, compiled, hf_model
    paired = [ratio(p, h) for p, h in zip(pagedkv_rates, hf_rates, strict=True)]
    fractions = [ratio(p, b) for p, b in zip(pagedkv_rates, bounds, strict=True)]
    compiled_fractions = [ratio(c, b) for c, b in zip(compiled_rates, bounds, strict=True)]
    compiled_gains = [ratio(c, p) for c, p in zip(compiled_rates, pagedkv_rates, strict=True)]
    hf_fractions = [ratio(h, b) for h, b in zip(hf_rates, bounds, strict=True)]
    result.figures[dtype] = {
        "weight_bytes_per_token": weight_bytes,
        "read_bandwidth_gb_per_s": [round(b * weight_bytes / 1e9, 2) for b in bounds],
        "read_kernels_gb_per_s": kernels,
        "bound_tokens_per_s": [round(b, 3) for b in bounds],
        "pagedkv_decode_tokens_per_s": [round(r, 3) for r in pagedkv_rates],
        "pagedkv_compiled_decode_tokens_per_s": [round(r, 3) for r in compiled_rates],
        "hf_generate_decode_tokens_per_s": [round(r, 3) for r in hf_rates],
        "median_pagedkv_decode_tokens_per_s": rounded(median(pagedkv_rates), 3),
        "median_pagedkv_compiled_decode_tokens_per_s": rounded(median(compiled_rates), 3),
        "median_hf_generate_decode_tokens_per_s": rounded(median(hf_rates), 3),
        "median_bound_tokens_per_s": rounded(median(bounds), 3),
    }
    result.add_ratio(
        f"{short}_pagedkv_vs_hf_generate",
        median(paired),
        f"{dtype} batch-1 decode tokens/s, pagedkv over transformers generate (0.6B shape), "
        "median over interleaved repetitions",
    )
    result.add_target(
        f"{short}_pagedkv_vs_hf_generate",
        ">=",
        1.0,
        f"batch-1 decode {short}: pagedkv >= 1.0x transformers generate",
    )
    result.add_ratio(
        f"{short}_fraction_of_bound",
        median(fractions),
        f"{dtype} batch-1 decode tokens/s of pagedkv over the bandwidth bound (the best "
        "float32 read rate of GEMVs through MKL and oneDNN, a sum and a copy / weight bytes per "
        "token, measured beside each repetition, the same for every dtype)",
    )
    result.add_target(
        f"{short}_fraction_of_bound",
        ">=",
        FRACTION_TARGET,
        f"batch-1 decode {short}: pagedkv >= {FRACTION_TARGET:.0%} of the dtype-free "
        "memory-bandwidth bound",
    )
    result.add_ratio(
        f"{short}_hf_fraction_of_bound",
        median(hf_fractions),
        f"{dtype} batch-1 decode tokens/s of transformers generate over the bandwidth bound",
    )
    result.add_ratio(
        f"{short}_compiled_fraction_of_bound",
        median(compiled_fractions),
        f"{dtype} batch-1 decode tokens/s of pagedkv with compile (ENG-115) over the same "
        "bandwidth bound",
    )
    result.add_target(
        f"{short}_compiled_fraction_of_bound",
        ">=",
        FRACTION_TARGET,
        f"batch-1 decode {short}, compiled: pagedkv >= {FRACTION_TARGET:.0%} of the dtype-free "
        "memory-bandwidth bound",
    )
    result.add_ratio(
        f"{short}_compiled_vs_eager",
        median(compiled_gains),
        f"{dtype} batch-1 decode tokens/s of pagedkv with compile over pagedkv eager",
    )
