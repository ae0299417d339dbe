"""Running a workload on pagedkv's own engine (v1 paged cache or v0 recompute)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.backend import ReferenceBackend
from pagedkv.bench.checkpoints import Checkpoint
from pagedkv.bench.requests import BenchRequest
from pagedkv.bench.run import RunResult
from pagedkv.device import DEFAULT_DEVICE
from pagedkv.engine.config import CacheMode, EngineConfig
from pagedkv.engine.outputs import RequestOutput, StepReport
from pagedkv.engine.params import OutputKind, SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.interfaces import Engine, StepRunner

#: Called after every engine step, e.g. to sample the KV cache's occupancy.
StepObserver = Callable[[StepReport], None]

#: Token budget of one step and sequences per step, for every pagedkv run of the benchmarks.
MAX_NUM_BATCHED_TOKENS = 512
MAX_NUM_SEQS = 64
PAGE_SIZE = 16


def load_runner(
    checkpoint: Checkpoint,
    num_pages: int,
    page_size: int = PAGE_SIZE,
    dtype: str = "float32",
    device: str = DEFAULT_DEVICE,
    options: RunnerOptions | None = None,
) -> ModelRunner:
    """The checkpoint's model with a preallocated K/V pool of ``num_pages`` pages, run with
    ``options``; unset, the defaults (on CUDA, decode steps replayed from CUDA graphs:
    ENG-205)."""
    if options is None:
        options = RunnerOptions()
    return ModelRunner.from_model_dir(
        checkpoint.path,
        num_pages=num_pages,
        page_size=page_size,
        dtype=dtype,
        device=device,
        options=options,
    )


def make_engine(
    runner: StepRunner,
    mode: CacheMode,
    num_pages: int,
    *,
    page_size: int = PAGE_SIZE,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
    backend: ReferenceBackend | None = None,
) -> Engine:
    """A fresh engine (empty queues, empty page pool) of ``backend`` (the reference by
    default) over an already loaded runner.

    The engine caps ``max_model_len`` by the positions the model was trained for (ENG-034).
    """
    config = EngineConfig(
        page_size=page_size,
        num_pages=num_pages,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        mode=mode,
    )
    return (backend or ReferenceBackend()).create_engine(runner, config)


def greedy_params(max_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly ``max_tokens`` tokens (EOS ignored), the output returned
    once, at the end (ENG-157), as ``generate`` asks and as the peers return theirs."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=OutputKind.FINAL_ONLY,
    )


def run_engine(
    engine: Engine,
    requests: Sequence[BenchRequest],
    system: str,
    observer: StepObserver | None = None,
) -> RunResult:
    """Submit every request at once, step until all finish; their timings.

    TTFT counts from each request's ``add_request`` (all at the start), so it includes the time
    spent queued behind other requests, as a server's TTFT would.
    """
    if observer is not None:
        engine.add_step_observer(observer)
    try:
        start = time.perf_counter()
        ids = [engine.add_request(r.prompt, greedy_params(r.max_tokens)) for r in requests]
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        wall = time.perf_counter() - start
    finally:
        if observer is not None:
            engine.remove_step_observer(observer)
    outputs = [finished[i] for i in ids]
    return result_of(system, outputs, wall)


def result_of(system: str, outputs: Sequence[RequestOutput], wall_s: float) -> RunResult:
    """A :class:`RunResult` from finished outputs' metrics."""
    ttft = [o.metrics.ttft for o in outputs]
    decode = [o.metrics.decode_time for o in outputs]
    return RunResult(
        system=system,
        output_tokens=sum(len(o.token_ids) for o in outputs),
        wall_s=wall_s,
        ttft_s=tuple(t for t in ttft if t is not None),
        decode_s=tuple(d for d in decode if d is not None),
        decode_tokens=tuple(len(o.token_ids) - 1 for o in outputs),
    )


def warm_up(engine: Engine, vocab: int) -> None:
    """Run two short requests so that one-time costs (kernel selection, allocator) are paid."""
    prompts = [BenchRequest(tuple(range(1, 1 + min(40, vocab - 1))), 4)] * 2
    run_engine(engine, prompts, "warm-up")


@dataclass(frozen=True, slots=True)
class PagedkvSystem:
    """pagedkv's engine as a :class:`~pagedkv.bench.system.SystemUnderTest`: each run on a
    fresh engine (empty queues, empty page pool) that ``make_engine`` builds over an already
    loaded runner, before the clock starts.

    Attributes:
        name: the system's name in the results.
        make_engine: builds the fresh engine of one run.
    """

    name: str
    make_engine: Callable[[], Engine]

    def run(self, requests: Sequence[BenchRequest]) -> RunResult:
        """Every request at once on a fresh engine (see :func:`run_engine`)."""
        return run_engine(self.make_engine(), requests, self.name)
