"""Engines of the backend over the backend's own model runner on a tiny real Qwen3, with a
recorder of the plans they run: what the engine suite's real-model cases share."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.interfaces import Backend, Engine, EngineBackend, ModelBackend, StepRunner
from pagedkv.plan import StepPlan
from pagedkv.testing.delegating_runner import DelegatingRunner


@dataclass(frozen=True, slots=True)
class ChunkSeen:
    """One sequence's share of one plan, as the runner received it."""

    start: int  # position of its first row
    num_rows: int
    context_len: int
    pages: tuple[int, ...]  # the pages covering its context, in page-table order

    @property
    def continues_context(self) -> bool:
        """A multi-row chunk attending over positions computed in earlier steps."""
        return self.num_rows > 1 and self.context_len > self.num_rows


class PlanRecorder(DelegatingRunner):
    """A StepRunner that records what each plan asked of the model, then runs it."""

    def __init__(self, inner: StepRunner, page_size: int) -> None:
        super().__init__(inner)
        self.page_size = page_size
        self.steps: list[list[ChunkSeen]] = []

    def execute(self, plan: StepPlan) -> torch.Tensor:
        batch = plan.attention
        starts = batch.query_start.tolist()
        contexts = batch.context_lens.tolist()
        positions = plan.positions.tolist()
        seen = []
        for b, (first, stop) in enumerate(itertools.pairwise(starts)):
            pages: tuple[int, ...] = ()
            if batch.page_tables is not None:
                used = -(-contexts[b] // self.page_size)
                pages = tuple(batch.page_tables[b, :used].tolist())
            seen.append(ChunkSeen(positions[first], stop - first, contexts[b], pages))
        self.steps.append(seen)
        return self.inner.execute(plan)

    @property
    def chunks(self) -> list[ChunkSeen]:
        return [c for step in self.steps for c in step]


def model_runner(
    backend: Backend,
    model_dir: Path,
    *,
    page_size: int,
    num_pages: int,
    device: str = "cpu",
) -> StepRunner:
    """The backend's runner for ``model_dir`` with a paged pool of ``num_pages`` pages."""
    if not isinstance(backend, ModelBackend):
        raise TypeError(f"backend {backend.name!r} declares 'model' but has no create_model_runner")
    return backend.create_model_runner(
        str(model_dir), num_pages=num_pages, page_size=page_size, device=device
    )


def model_engine(
    backend: Backend,
    model_dir: Path,
    config: EngineConfig,
    device: str = "cpu",
) -> tuple[Engine, PlanRecorder]:
    """The backend's engine over its own runner for ``model_dir``, shaped by ``config``."""
    if not isinstance(backend, EngineBackend):
        raise TypeError(f"backend {backend.name!r} declares 'engine' but has no create_engine")
    runner = model_runner(
        backend, model_dir, page_size=config.page_size, num_pages=config.num_pages, device=device
    )
    recorder = PlanRecorder(runner, config.page_size)
    return backend.create_engine(recorder, config), recorder


def run_all(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    stagger: int = 0,
) -> list[RequestOutput]:
    """Greedy outputs (EOS ignored) of every prompt; with ``stagger`` > 0 each prompt after the
    first is added only after that many more steps, so it meets a cache and a running batch."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = list(prompts)
    ids: list[str] = []
    done: dict[str, RequestOutput] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and (stagger == 0 or steps % stagger == 0):
            ids.append(engine.add_request(list(pending.pop(0)), params))
            if stagger == 0:
                continue
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        engine.check_invariants()
        steps += 1
        if steps > 10_000:
            raise AssertionError("the engine never finished")
    return [done[i] for i in ids]
