"""The engine: each step is schedule → plan → execute → sample → update → detokenize.

The scheduler picks the work and builds its plan; the runner computes logits; the engine samples
the sequences the step completed; the scheduler applies the tokens (progress, commits, stop
conditions, frees); the engine turns them into text and outputs. The engine never touches the
KVManager or a request's progress itself: the scheduler is their only owner.

One request's failure is that request's alone (ENG-070..072): an error in one row's sampling
or in one request's text fails that request and no other, and a step whose model run raises is
applied as nothing and tried again (the scheduler decides how often, and which request then
fails). ``step()`` never raises for either.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path

import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import EngineStats, FinishReason, RequestOutput, StepReport
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import Request
from pagedkv.engine.sampler import sample, token_logprobs
from pagedkv.engine.scheduler import SampledToken, SampleError, SchedulerOutput, make_scheduler
from pagedkv.engine.tokenizer import IncrementalText, Tokenizer
from pagedkv.errors import InvalidRequest, RequestTooLong
from pagedkv.interfaces import KVManager, StepRunner
from pagedkv.plan import StepPlan

#: Called after every step that ran, with what the step did.
StepObserver = Callable[[StepReport], None]


class LLMEngine:
    """Continuous batching over one page pool (ENG-001..).

    Args:
        runner: runs the step plans.
        config: budgets and cache mode.
        kv_manager: the page pool of a v1 engine, built by a backend
            (:meth:`pagedkv.backend.ReferenceBackend.create_engine`); a v0 engine takes none.
        tokenizer: turns text prompts into ids and ids into text; optional.
        eos_ids: tokens that end a request unless it ignores EOS.

    Raises:
        InvalidRequest: a v1 config without ``kv_manager``, or a v0 config with one.
    """

    def __init__(
        self,
        runner: StepRunner,
        config: EngineConfig,
        *,
        kv_manager: KVManager | None = None,
        tokenizer: Tokenizer | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer
        limit = config.max_model_len
        if runner.max_positions is not None:  # never past what the model was trained for
            limit = min(limit, runner.max_positions)
        self.scheduler = make_scheduler(config, kv_manager, eos_ids=eos_ids, max_model_len=limit)
        self.max_model_len = self.scheduler.max_model_len
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, IncrementalText] = {}
        self._observers: list[StepObserver] = []
        self._ids = itertools.count()
        self._seed_source = torch.Generator().manual_seed(0)
        self._steps = 0
        self._tokens_computed = 0
        self._prefill_tokens_computed = 0
        self._peak_pages = 0

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> LLMEngine:
        """Load a Hugging Face format Qwen3 directory, its tokenizer if it has one, and EOS,
        with pagedkv's reference backend (which builds the page pool)."""
        from pagedkv.backend import ReferenceBackend

        return ReferenceBackend().load_engine(model_dir, config, dtype=dtype, device=device)

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises a typed error, queuing nothing, if it is
        invalid or could never fit (ENG-033)."""
        params = params or SamplingParams()
        prompt_ids = self._prompt_ids(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestTooLong(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} = {total} "
                f"exceeds the {self.max_model_len} positions one sequence may hold"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer")
        generator = None
        if not params.greedy:
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source).item())
            generator = torch.Generator().manual_seed(seed)
        request = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_ids),
            params=params,
            cache_salt=cache_salt,
            arrival_time=time.perf_counter(),
            generator=generator,
            logprobs=[] if params.logprobs is not None else None,
        )
        self._requests[request_id] = request
        if self.tokenizer is not None:
            self._texts[request_id] = IncrementalText(self.tokenizer, params.stop)
        self.scheduler.add(request)
        return request_id

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("a text prompt needs a model directory with a tokenizer")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary of {vocab}")
        return ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now and free every page it holds (ENG-012). Returns its final output,
        or ``None`` if it had already finished."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, FinishReason.ABORT)
        self._forget(request)
        return self._output(request, (), "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the outputs of the requests it advanced or failed
        (finish reason ``error``, ENG-070..072)."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return []
        scheduled_at = time.perf_counter()
        try:
            plan = self.scheduler.build_plan(scheduled, self.runner.device)
            planned_at = time.perf_counter()
            logits = self._execute(plan, len(scheduled.chunks))
        except Exception as exc:  # the whole step failed: none of it is applied (ENG-071)
            failed = self.scheduler.update_from_failure(scheduled, _describe(exc))
            return [self._guarded_output(request) for request in failed]
        executed_at = time.perf_counter()
        sampled = self._sample(scheduled, logits)
        sampled_at = time.perf_counter()
        advanced = self.scheduler.update_from_output(scheduled, sampled)
        updated_at = time.perf_counter()
        outputs = [self._guarded_output(request) for request in advanced]
        done_at = time.perf_counter()
        self._count(scheduled)
        if self._observers:
            report = StepReport(
                num_seqs=len(scheduled.chunks),
                num_tokens=scheduled.num_tokens,
                num_prompt_tokens=sum(c.num_prompt_tokens for c in scheduled.chunks),
                num_preempted=len(scheduled.preempted),
                num_finished=sum(1 for o in outputs if o.finished),
                schedule_s=scheduled_at - start,
                plan_s=planned_at - scheduled_at,
                execute_s=executed_at - planned_at,
                sample_s=sampled_at - executed_at,
                update_s=updated_at - sampled_at,
                output_s=done_at - updated_at,
                kv_positions=sum(r.num_computed_tokens for r in self.scheduler.running),
                stats=self.stats(),
            )
            for observer in tuple(self._observers):
                observer(report)
        return outputs

    def _execute(self, plan: StepPlan, num_seqs: int) -> torch.Tensor:
        """The runner's logits for ``plan``, one row per sequence."""
        logits = self.runner.execute(plan)
        if logits.dim() != 2 or logits.shape[0] != num_seqs:
            raise InvalidRequest(
                f"the runner returned logits of shape {tuple(logits.shape)} for {num_seqs} "
                "sequences"
            )
        return logits

    def _sample(
        self, scheduled: SchedulerOutput, logits: torch.Tensor
    ) -> list[SampledToken | SampleError | None]:
        """The next token of every chunk that completes its sequence (logits row = chunk); a
        row whose sampling raises gets a :class:`SampleError`, the others their token
        (ENG-070)."""
        sampled: list[SampledToken | SampleError | None] = []
        for row, chunk in enumerate(scheduled.chunks):
            if not chunk.completes_sequence:
                sampled.append(None)
                continue
            try:
                sampled.append(self._sample_row(chunk.request, logits[row]))
            except Exception as exc:  # this request's own sampling: it fails alone
                sampled.append(SampleError(f"sampling failed: {_describe(exc)}"))
        return sampled

    def _sample_row(self, request: Request, logits: torch.Tensor) -> SampledToken:
        params = request.params
        token = sample(logits, params, request.generator)
        logprobs = None
        if params.logprobs is not None:
            logprobs = token_logprobs(logits, token, params.logprobs)
        return SampledToken(token, logprobs)

    def _guarded_output(self, request: Request) -> RequestOutput:
        """The output of a request the step advanced or failed. An error in its text or stop
        strings fails it alone (ENG-070); a failed request's output carries no new token."""
        if request.finish_reason is not FinishReason.ERROR:
            try:
                return self._detokenize(request)
            except Exception as exc:  # this request's own text: it fails alone
                self.scheduler.fail(request, f"detokenizing failed: {_describe(exc)}")
        self._forget(request)
        return self._output(request, (), "")

    def _detokenize(self, request: Request) -> RequestOutput:
        """The output of a request that just got a token; a stop string ends it here."""
        new_text = ""
        text = self._texts.get(request.request_id)
        if text is not None:
            new_text, stopped = text.update(request.output_token_ids, final=request.finished)
            if stopped and not request.finished:
                self.scheduler.finish(request, FinishReason.STOP)
                new_text, _ = text.update(request.output_token_ids, final=True)
            request.text = text.text
        if request.finished:
            self._forget(request)
        return self._output(request, (request.token_ids[-1],), new_text)

    def _count(self, scheduled: SchedulerOutput) -> None:
        self._steps += 1
        self._tokens_computed += scheduled.num_tokens
        self._prefill_tokens_computed += sum(c.num_prompt_tokens for c in scheduled.chunks)
        self._peak_pages = max(self._peak_pages, self.scheduler.kv_stats().pages_in_use)

    def _forget(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        self._texts.pop(request.request_id, None)

    def _output(self, request: Request, new_ids: tuple[int, ...], new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=tuple(request.output_token_ids),
            new_token_ids=new_ids,
            text=request.text,
            new_text=new_text,
            finished=request.finished,
            finish_reason=request.finish_reason,
            logprobs=tuple(request.logprobs) if request.logprobs is not None else None,
            metrics=request.metrics(),
            error=request.error,
        )

    # -- observation -----------------------------------------------------------------------

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call ``observer`` with a :class:`StepReport` after every step that ran (ENG-051)."""
        self._observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        """Stop calling ``observer``; unknown observers are ignored."""
        if observer in self._observers:
            self._observers.remove(observer)

    def stats(self) -> EngineStats:
        """Engine-wide counters (ENG-050)."""
        kv = self.scheduler.kv_stats()
        return EngineStats(
            num_pages=kv.num_pages,
            pages_in_use=kv.pages_in_use,
            pages_free=kv.pages_free,
            pages_cached=kv.pages_cached,
            peak_pages_in_use=self._peak_pages,
            query_tokens=kv.query_tokens,
            hit_tokens=kv.hit_tokens,
            prefill_tokens_computed=self._prefill_tokens_computed,
            tokens_computed=self._tokens_computed,
            steps=self._steps,
            preemptions=self.scheduler.num_preemptions,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            failed_steps=self.scheduler.num_failed_steps,
        )

    def check_invariants(self) -> None:
        """The scheduler's invariants (for v1, its KVManager's and the pages of the running
        requests)."""
        self.scheduler.check_invariants()

    # -- convenience -----------------------------------------------------------------------

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Generator[RequestOutput, None, None]:
        """Add a request and yield its outputs step by step until it finishes (ENG-013).

        Other queued requests advance in the same steps. Closing the iterator early aborts
        the request and frees its pages.
        """
        request_id = self.add_request(prompt, params, cache_salt=cache_salt)
        finished = False
        try:
            while not finished:
                for output in self.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.abort(request_id)


def _describe(exc: Exception) -> str:
    """An error as a request's failure message: its type and message."""
    return f"{type(exc).__name__}: {exc}"
