"""The rows of the device workload (ENG-208), each with its fraction of the memory bound.

* ``decode``: one request, its decode after the first token timed (on CUDA by CUDA events
  recorded after each engine step; elsewhere by ``time.perf_counter``), pagedkv under each
  runner variant beside transformers ``generate``;
* ``requests``: 8 and 32 requests submitted at once (output tokens over the wall time, prefill
  included), pagedkv beside transformers ``generate`` on one static batch;
* ``mixed``: the mixed workload, pagedkv beside transformers' continuous batching
  (``generate_batch``'s manager);
* ``nanovllm``: nano-vllm's benchmark workload, pagedkv alone, cut between steps when its
  share of the budget is spent (the tokens made so far then count).

Every row's bound is :mod:`pagedkv.bench.bound`'s over the memory rate a large device copy
measured at the start of the part. Each figure is logged as it is measured.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.bench.bound import ModelBytes, Span, copy_rate, fraction_of_bound, read_bytes
from pagedkv.bench.budget import Share, cut_note
from pagedkv.bench.checkpoints import Checkpoint
from pagedkv.bench.context import BenchContext
from pagedkv.bench.device_sizes import DeviceSizes, nanovllm_requests
from pagedkv.bench.hf_systems import (
    HF_GENERATE,
    HF_GENERATE_BATCH,
    HfGenerate,
    HfGenerateBatch,
    has_generate_batch,
    load_hf_model,
)
from pagedkv.bench.limits import fastest
from pagedkv.bench.pagedkv_system import (
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PAGE_SIZE,
    greedy_params,
    load_runner,
    make_engine,
    result_of,
    run_engine,
)
from pagedkv.bench.requests import BenchRequest, mixed_requests, uniform_requests
from pagedkv.bench.results import WorkloadResult
from pagedkv.bench.run import RunResult
from pagedkv.bench.stats import median, ratio, rounded
from pagedkv.engine.outputs import RequestOutput, StepReport
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.interfaces import Engine
from pagedkv.model.config import ModelConfig

#: The runner variants pagedkv is timed under in the decode and request rows, by system name.
#: The hook for alternative kernels: add a variant here and every such row times it beside the
#: others. ``pagedkv`` is the runner's defaults; ``pagedkv-triton`` the Triton kernels (paged
#: attention read in place and the fused norms, rotations and activations, ENG-199, ENG-220),
#: whose decode graphs are captured per batch size at start (ENG-228).
RUNNER_VARIANTS: dict[str, RunnerOptions] = {
    "pagedkv": RunnerOptions(),
    "pagedkv-triton": RunnerOptions(attention="triton", fused_ops="triton"),
}


def runner_variants(device: str) -> dict[str, RunnerOptions]:
    """The variants of :data:`RUNNER_VARIANTS` that run on ``device``: the Triton one on a
    CUDA device with triton installed only (the CPU runs Triton only under its interpreter,
    which times nothing a user runs)."""
    triton_runs = device.startswith("cuda") and importlib.util.find_spec("triton") is not None
    return {
        name: options
        for name, options in RUNNER_VARIANTS.items()
        if triton_runs or options == RunnerOptions()
    }


@dataclass
class Part:
    """What one part needs: the run, the sizes, its share of the budget, the checkpoint and
    the result the part writes into."""

    ctx: BenchContext
    sizes: DeviceSizes
    share: Share
    checkpoint: Checkpoint
    result: WorkloadResult
    variants: dict[str, RunnerOptions]

    def cut(self, done: int, total: int, unit: str) -> bool:
        """Whether the part's share is spent; if so the cut is noted and logged."""
        if not self.share.spent():
            return False
        note = cut_note(self.share.name, done, total, unit)
        self.result.notes.append(note)
        self.ctx.log(f"device: {note}")
        return True

    def record(self, row: str, system: str, tokens_per_s: float, fraction: float) -> None:
        """Keep and log one system's figure of one row."""
        rows = self.result.figures.setdefault("rows", {})
        rows.setdefault(row, {})[system] = {
            "tokens_per_s": rounded(tokens_per_s, 3),
            "fraction_of_bound": rounded(fraction, 4),
        }
        self.result.add_ratio(
            f"{row}_{system}_fraction_of_bound",
            fraction,
            f"{row}: the memory bound's seconds over {system}'s (pagedkv.bench.bound)",
        )
        self.ctx.log(
            f"device: {row}: {system}: {tokens_per_s:.2f} tokens/s, "
            f"{fraction:.4f} of the memory bound"
        )


def memory_rate(device: str, nbytes: int) -> float:
    """Bytes per second the device's memory moved in the fastest of three copies of an
    ``nbytes`` tensor (read and written: :func:`~pagedkv.bench.bound.copy_rate`)."""
    source = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = fastest(lambda: target.copy_(source), 3, device)
    return copy_rate(source.numel() * 4, seconds)


def model_bytes(runner: ModelRunner) -> ModelBytes:
    """What one step of ``runner``'s model reads (its weights, and K/V per position)."""
    config = runner.model.config
    itemsize = next(runner.model.parameters()).element_size()
    return ModelBytes.of(
        runner.weight_bytes,
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        itemsize=itemsize,
    )


class StepClock:
    """A step observer marking the end of each engine step: a CUDA event recorded on the
    current stream on CUDA, ``time.perf_counter`` elsewhere."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.marks: list[Any] = []

    def __call__(self, report: StepReport) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self, first: int, last: int) -> float:
        """Seconds from the end of step ``first`` to the end of step ``last``."""
        if self.cuda:
            torch.cuda.synchronize()
            return float(self.marks[first].elapsed_time(self.marks[last])) / 1e3
        return float(self.marks[last] - self.marks[first])


def _pages(requests: Sequence[BenchRequest]) -> int:
    return sum(-(-r.total_len // PAGE_SIZE) for r in requests) + 16


def _spans(requests: Sequence[BenchRequest]) -> list[Span]:
    return [Span(len(r.prompt), r.max_tokens) for r in requests]


def decode_part(part: Part) -> None:
    """Batch-1 decode, timed after the first token, each dtype in turn."""
    sizes, ctx = part.sizes, part.ctx
    prompt = uniform_requests(1, sizes.decode_prompt, 1, _vocab(part), ctx.seed)[0].prompt
    request = BenchRequest(prompt, sizes.decode_tokens + 1)
    for done, dtype in enumerate(sizes.dtypes):
        if part.cut(done, len(sizes.dtypes), "dtypes"):
            return
        row = f"decode_{_short(dtype)}"
        rate = memory_rate(ctx.device, sizes.copy_bytes)
        pages = _pages([request])
        runners = {
            name: load_runner(part.checkpoint, pages, dtype=dtype, device=ctx.device, options=o)
            for name, o in part.variants.items()
        }
        bytes_of = model_bytes(next(iter(runners.values())))
        # Tokens 2 .. n, each attending the prompt, the first token and those before it.
        nbytes = read_bytes([Span(sizes.decode_prompt + 1, sizes.decode_tokens)], bytes_of, 1)
        samples: dict[str, list[float]] = {}
        for name, runner in runners.items():
            # The whole request once: every gather width it reaches is captured here.
            run_engine(make_engine(runner, "v1", pages), [request], "warm-up")
            for _ in range(sizes.decode_repeats):
                samples.setdefault(name, []).append(_timed_decode(runner, pages, request, ctx))
        hf = HfGenerate(load_hf_model(part.checkpoint, dtype, ctx.device), batch_size=1)
        hf.run([BenchRequest(request.prompt, 3)])
        for _ in range(sizes.decode_repeats):
            run = hf.run([request])
            samples.setdefault(HF_GENERATE, []).append(sum(run.decode_s))
        for system, seconds in samples.items():
            best = median(seconds)
            part.record(
                row,
                system,
                ratio(sizes.decode_tokens, best),
                fraction_of_bound(nbytes, rate, best),
            )
        _ratios(part, row, samples)
        part.result.figures.setdefault("memory_rate_gb_per_s", {})[row] = round(rate / 1e9, 2)
        del runners, hf


def _warm(runner: ModelRunner, pages: int, request: BenchRequest) -> None:
    """One short run, so that one-time costs (captures, kernel choice) are paid first."""
    run_engine(make_engine(runner, "v1", pages), [BenchRequest(request.prompt, 4)], "warm-up")


def _timed_decode(
    runner: ModelRunner, pages: int, request: BenchRequest, ctx: BenchContext
) -> float:
    """Seconds of the decode steps after the first token: from the end of the step that made
    it to the end of the last.

    Raises:
        RuntimeError: the prompt took more than one step, so no step made the first token.
    """
    clock = StepClock(ctx.device)
    run_engine(make_engine(runner, "v1", pages), [request], "pagedkv", observer=clock)
    if len(clock.marks) != request.max_tokens:
        raise RuntimeError(
            f"{len(clock.marks)} steps for {request.max_tokens} tokens: the prompt was not "
            "prefilled in one step"
        )
    return clock.seconds(0, len(clock.marks) - 1)


def requests_part(part: Part) -> None:
    """Batches of requests submitted at once, pagedkv beside one static ``generate`` batch."""
    sizes, ctx = part.sizes, part.ctx
    rows = [(dtype, batch) for dtype in sizes.dtypes for batch in sizes.batches]
    loaded: str | None = None
    runners: dict[str, ModelRunner] = {}
    hf: HfGenerate | None = None
    pages = max(sizes.batches) * -(-(sizes.rows_prompt + sizes.rows_new) // PAGE_SIZE) + 16
    for done, (dtype, batch) in enumerate(rows):
        if part.cut(done, len(rows), "rows"):
            return
        if loaded != dtype:
            runners.clear()
            runners = {
                n: load_runner(part.checkpoint, pages, dtype=dtype, device=ctx.device, options=o)
                for n, o in part.variants.items()
            }
            hf = HfGenerate(load_hf_model(part.checkpoint, dtype, ctx.device))
            warm = [BenchRequest(tuple(range(1, 9)), 3)] * 2
            for runner in runners.values():
                run_engine(make_engine(runner, "v1", pages), warm, "warm-up")
            hf.run(warm)
            loaded = dtype
        assert hf is not None  # loaded with the runners above
        row = f"{_short(dtype)}_bs{batch}"
        rate = memory_rate(ctx.device, sizes.copy_bytes)
        requests = uniform_requests(
            batch, sizes.rows_prompt, sizes.rows_new, _vocab(part), ctx.seed + batch
        )
        nbytes = read_bytes(_spans(requests), model_bytes(next(iter(runners.values()))), batch)
        samples: dict[str, list[float]] = {}
        for _ in range(sizes.rows_repeats):
            for name, runner in runners.items():
                engine = make_engine(runner, "v1", pages, max_num_batched_tokens=sizes.step_tokens)
                samples.setdefault(name, []).append(run_engine(engine, requests, name).wall_s)
            samples.setdefault(HF_GENERATE, []).append(hf.run(requests).wall_s)
        _record_walls(part, row, samples, sum(r.max_tokens for r in requests), nbytes, rate)


def mixed_part(part: Part) -> None:
    """The mixed workload in bfloat16 (the first dtype), pagedkv beside ``generate_batch``."""
    sizes, ctx = part.sizes, part.ctx
    dtype = sizes.dtypes[0]
    row = f"mixed_{_short(dtype)}"
    requests = mixed_requests(sizes.mixed, _vocab(part), ctx.seed)
    pages = _pages(requests)
    runner = load_runner(part.checkpoint, pages, dtype=dtype, device=ctx.device)
    # The whole workload once: the shapes its steps reach are captured before the clock.
    run_engine(make_engine(runner, "v1", pages), requests, "warm-up")
    hf_model = load_hf_model(part.checkpoint, dtype, ctx.device)
    systems: dict[str, Callable[[], RunResult]] = {
        "pagedkv": lambda: run_engine(make_engine(runner, "v1", pages), requests, "pagedkv"),
    }
    if has_generate_batch(hf_model):
        batch = HfGenerateBatch(
            hf_model,
            page_size=PAGE_SIZE,
            num_blocks=pages,
            max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
            max_requests_per_batch=MAX_NUM_SEQS,
        )
        try:
            batch.run(requests[:2])  # warm-up
            systems[HF_GENERATE_BATCH] = lambda: batch.run(requests)
        except Exception as exc:  # recorded: the baseline may fail where pagedkv runs
            part.result.errors[HF_GENERATE_BATCH] = f"{type(exc).__name__}: {exc}"
    else:
        part.result.notes.append("the installed transformers has no generate_batch")
    rate = memory_rate(ctx.device, sizes.copy_bytes)
    nbytes = read_bytes(_spans(requests), model_bytes(runner), MAX_NUM_SEQS)
    samples: dict[str, list[float]] = {}
    for done in range(sizes.mixed_repeats):
        if part.cut(done, sizes.mixed_repeats, "repetitions"):
            break
        for name, system in systems.items():
            samples.setdefault(name, []).append(system().wall_s)
    _record_walls(part, row, samples, sum(r.max_tokens for r in requests), nbytes, rate)


def nanovllm_part(part: Part) -> None:
    """nano-vllm's workload in bfloat16, pagedkv alone, cut between steps by its share."""
    sizes, ctx = part.sizes, part.ctx
    dtype = sizes.dtypes[0]
    row = f"nanovllm_{_short(dtype)}"
    requests = nanovllm_requests(
        sizes.nano_seqs, sizes.nano_low, sizes.nano_high, _vocab(part), ctx.seed
    )
    pages = _pages(requests)
    runner = load_runner(part.checkpoint, pages, dtype=dtype, device=ctx.device)
    _warm(runner, pages, requests[0])
    engine = make_engine(
        runner,
        "v1",
        pages,
        max_num_seqs=sizes.nano_seqs,
        max_num_batched_tokens=sizes.nano_step_tokens,
        max_model_len=2 * sizes.nano_high + PAGE_SIZE,
    )
    rate = memory_rate(ctx.device, sizes.copy_bytes)
    run, outputs = _run_until(engine, requests, part)
    spans = [Span(len(r.prompt), len(o.token_ids)) for r, o in zip(requests, outputs, strict=True)]
    nbytes = read_bytes(spans, model_bytes(runner), sizes.nano_seqs)
    part.result.figures["nanovllm"] = {
        "sequences": sizes.nano_seqs,
        "lengths": [sizes.nano_low, sizes.nano_high],
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens_asked": sum(r.max_tokens for r in requests),
        "output_tokens_made": run.output_tokens,
        "wall_s": round(run.wall_s, 3),
    }
    part.record(row, "pagedkv", run.tokens_per_s, fraction_of_bound(nbytes, rate, run.wall_s))


def _run_until(
    engine: Engine, requests: Sequence[BenchRequest], part: Part
) -> tuple[RunResult, list[RequestOutput]]:
    """Every request at once, stepped until all finish or the part's share is spent; then the
    unfinished are aborted, their tokens so far counted. The run and each request's output."""
    start = time.perf_counter()
    ids = [engine.add_request(r.prompt, greedy_params(r.max_tokens)) for r in requests]
    finished: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if part.cut(len(finished), len(ids), "sequences finished"):
            break
        steps += 1
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    wall = time.perf_counter() - start
    for request_id in ids:
        if request_id not in finished:
            aborted = engine.abort(request_id)
            if aborted is not None:
                finished[request_id] = aborted
    outputs = [finished[i] for i in ids]
    part.result.figures["nanovllm_steps"] = steps
    return result_of("pagedkv", outputs, wall), outputs


def _record_walls(
    part: Part,
    row: str,
    samples: dict[str, list[float]],
    tokens: int,
    nbytes: int,
    rate: float,
) -> None:
    """Record each system's median wall time (seconds) of ``row`` as tokens/s and as its
    fraction of the bound (``nbytes`` read at ``rate`` bytes/s), then the ratios."""
    for system, walls in samples.items():
        wall = median(walls)
        part.record(row, system, ratio(tokens, wall), fraction_of_bound(nbytes, rate, wall))
    _ratios(part, row, samples)


def _ratios(part: Part, row: str, samples: dict[str, list[float]]) -> None:
    """Each pagedkv system's speed over each other system's in ``row``: the ratio of the
    medians of their times (the lower the time, the faster)."""
    theirs = [s for s in samples if s not in part.variants]
    for ours in (s for s in samples if s in part.variants):
        for other in theirs:
            part.result.add_ratio(
                f"{row}_{ours}_vs_{other}",
                ratio(median(samples[other]), median(samples[ours])),
                f"{row}: tokens/s of {ours} over {other} (medians of their timed runs)",
            )


def _vocab(part: Part) -> int:
    return ModelConfig.from_dir(part.checkpoint.path).vocab_size


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
