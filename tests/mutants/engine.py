"""Deliberately broken engines and samplers: the reference engine with one bug each.

Most bugs sit at a Protocol boundary: a StepRunner wrapper between the engine and the model (the
plan the model receives is what an engine with the bug would build) or an Engine wrapper (what
a caller sees). Two cannot: the queue order after a preemption lives in the reference's
scheduler, and the sampling filters in its sampler module; those two mutants name the internals
they replace.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from pagedkv.engine.generation_config import GenerationDefaults
from pagedkv.engine.outputs import EngineStats, RequestOutput, StepReport
from pagedkv.engine.params import OutputKind, SamplingParams
from pagedkv.engine.prompts import PromptType
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.interfaces import Engine
from pagedkv.plan import StepPlan
from pagedkv.testing.delegating_runner import DelegatingRunner

# -- StepRunner wrappers: the plan an engine with the bug would hand the model -----------------


class ChunkPositionsRestart(DelegatingRunner):
    """(engine-a) a multi-row chunk that continues a cached context (a later prefill chunk, the
    suffix after a prefix hit, a recompute) is given positions from 0 instead of from its
    start (class 1, ENG-020/ENG-031)."""

    def execute(self, plan: StepPlan) -> torch.Tensor:
        positions = plan.positions.clone()
        starts = plan.attention.query_start.tolist()
        for first, stop in itertools.pairwise(starts):
            if stop - first > 1 and int(positions[first]) > 0:
                positions[first:stop] = torch.arange(stop - first)
        return self.inner.execute(dataclasses.replace(plan, positions=positions))


class NoPositionLimit(DelegatingRunner):
    """(engine-b) the engine never asks the model how many positions it was trained for, so
    ``max_model_len`` alone caps a sequence (class 7, ENG-034)."""

    @property
    def max_positions(self) -> int | None:
        return None


# -- Engine wrappers: what a caller of an engine with the bug sees ------------------------------


class _EngineWrapper:
    """Satisfies the Engine Protocol by delegating to the reference engine; subclasses change
    the requests going in or the outputs coming out."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.inner.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return self.inner.generation_defaults

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        return self.inner.add_request(
            prompt, self.params(params), request_id=request_id, cache_salt=cache_salt
        )

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        return params

    def output(self, output: RequestOutput) -> RequestOutput:
        return output

    def step(self) -> list[RequestOutput]:
        return [self.output(o) for o in self.inner.step()]

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.inner.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.inner.has_unfinished_requests()

    def stream(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Generator[RequestOutput, None, None]:
        for output in self.inner.stream(prompt, self.params(params), cache_salt=cache_salt):
            yield self.output(output)

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def add_step_observer(self, observer: Callable[[StepReport], None]) -> None:
        self.inner.add_step_observer(observer)

    def remove_step_observer(self, observer: Callable[[StepReport], None]) -> None:
        self.inner.remove_step_observer(observer)

    def check_invariants(self) -> None:
        self.inner.check_invariants()


class StopStringsIgnored(_EngineWrapper):
    """(engine-c) stop strings are dropped from the request: generation runs on past them and
    the text keeps them (class 4, ENG-043)."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        return None if params is None else dataclasses.replace(params, stop=())


class NewTextIsWholeText(_EngineWrapper):
    """(engine-d) each step's ``new_text`` carries the whole text so far, so a stream of them
    does not add up to the text (class 4, ENG-013)."""

    def output(self, output: RequestOutput) -> RequestOutput:
        outputs = tuple(dataclasses.replace(c, new_text=c.text) for c in output.outputs)
        return dataclasses.replace(output, outputs=outputs)


class OutputKindIgnored(_EngineWrapper):
    """(engine-f) ``output_kind`` is dropped from the request: a ``final_only`` request gets
    an output from every step (ENG-157)."""

    def params(self, params: SamplingParams | None) -> SamplingParams | None:
        if params is None:
            return None
        return dataclasses.replace(params, output_kind=OutputKind.EVERY_STEP)


# -- adjustments of the reference engine's internals ---------------------------------------------


def preempted_requests_queue_last(engine: Any) -> None:
    """(engine-e) a preempted request goes to the back of the waiting queue, behind requests
    that arrived after it (class 5, ENG-030). Replaces the reference paged scheduler's
    ``_preempt``, whose last act is to put the request back at the head of ``waiting``."""
    scheduler = engine.scheduler
    if not hasattr(scheduler, "_preempt"):
        return  # a v0 (recompute) engine never preempts
    original = scheduler._preempt

    def preempt(request: Any) -> None:
        original(request)
        scheduler.waiting.remove(request)
        scheduler.waiting.append(request)

    scheduler._preempt = preempt


def _filter(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    top_k_cut: int = 0,
    top_p_strict: bool = False,
) -> torch.Tensor:
    """One row of the sampler's filter with two classic slips: top-k keeping
    ``top_k - top_k_cut`` tokens, and top-p keeping only tokens whose cumulative mass,
    themselves included, stays within ``top_p`` (so it stops short of reaching it)."""
    scaled = logits / params.temperature
    if params.top_k > 0:
        keep = max(1, params.top_k - top_k_cut)
        kth = torch.topk(scaled, keep).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        through = torch.cumsum(sorted_probs, dim=-1)
        drop = (
            (through > params.top_p) if top_p_strict else (through - sorted_probs >= params.top_p)
        )
        drop[0] = False
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _patch_filter(engine: Any, **slip: Any) -> None:
    """Make this engine's sampling use the slipped filter: its ``_sample_rows`` runs with
    ``pagedkv.engine.sampler.filtered_probs_batch`` (which ``sample_rows`` calls) swapped
    for the duration of the call, so no other engine of the process is touched."""
    import pagedkv.engine.sampler as sampler

    def slipped(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        return torch.stack([_filter(row, p, **slip) for row, p in zip(logits, params, strict=True)])

    original = engine._sample_rows

    def sample_rows(logits: torch.Tensor, rows: Any) -> Any:
        saved = sampler.filtered_probs_batch
        sampler.filtered_probs_batch = slipped
        try:
            return original(logits, rows)
        finally:
            sampler.filtered_probs_batch = saved

    engine._sample_rows = sample_rows


def top_k_keeps_one_less(engine: Any) -> None:
    """(sampler-a) top-k keeps k-1 tokens: too few (class 6, ENG-040)."""
    _patch_filter(engine, top_k_cut=1)


def top_p_stops_short(engine: Any) -> None:
    """(sampler-b) top-p keeps the tokens strictly inside the mass, never the one that reaches
    it: too few (class 6, ENG-040)."""
    _patch_filter(engine, top_p_strict=True)


def top_k_keeps_one_more(engine: Any) -> None:
    """(sampler-c) top-k keeps k+1 tokens: too many (ENG-040)."""
    _patch_filter(engine, top_k_cut=-1)
