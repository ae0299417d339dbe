"""The engine: each step is schedule → run → postprocess.

The scheduler picks the work and the KVManager its pages; the plan builder turns that into an
explicit :class:`~pagedkv.plan.StepPlan`; the runner computes logits; postprocessing commits
newly written full pages to the prefix index, samples, checks stop conditions and frees the
pages of finished requests.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Generator, Sequence
from pathlib import Path

import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import EngineStats, FinishReason, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.sampler import sample, token_logprobs
from pagedkv.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from pagedkv.engine.tokenizer import IncrementalText, Tokenizer, eos_token_ids
from pagedkv.errors import InvalidRequest, InvariantViolation, RequestTooLong
from pagedkv.interfaces import KVManager, KVManagerConfig, StepRunner
from pagedkv.kv.manager import ReferenceKVManager
from pagedkv.plan import SeqChunk, StepPlan, build_plan


class LLMEngine:
    """Continuous batching over one page pool (ENG-001..)."""

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
        self.eos_ids = eos_ids
        if config.mode == "v1" and kv_manager is None:
            kv_manager = ReferenceKVManager(
                KVManagerConfig(config.num_pages, config.page_size, config.enable_prefix_caching)
            )
        self.kv: KVManager | None = kv_manager if config.mode == "v1" else None
        self.max_model_len = config.max_model_len
        if runner.max_positions is not None:  # never past what the model was trained for
            self.max_model_len = min(self.max_model_len, runner.max_positions)
        if self.kv is not None:
            self.max_model_len = min(self.max_model_len, self.kv.num_pages * self.kv.page_size)
        self.scheduler = Scheduler(config, self.kv)
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, IncrementalText] = {}
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
        kv_manager: KVManager | None = None,
    ) -> LLMEngine:
        """Load a Hugging Face format Qwen3 directory, its tokenizer if it has one, and EOS."""
        from pagedkv.engine.runner import ModelRunner

        config = config or EngineConfig()
        runner = ModelRunner.from_model_dir(
            model_dir,
            num_pages=config.num_pages if config.mode == "v1" else None,
            page_size=config.page_size,
            dtype=dtype,
            device=device,
        )
        path = Path(model_dir)
        has_tokenizer = (path / "tokenizer.json").exists()
        return cls(
            runner,
            config,
            kv_manager=kv_manager,
            tokenizer=Tokenizer(path) if has_tokenizer else None,
            eos_ids=eos_token_ids(path),
        )

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
        elif params.stop:
            raise InvalidRequest("stop strings need a tokenizer")
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
        self._finish(request, FinishReason.ABORT)
        return self._output(request, (), "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the outputs of the requests it advanced."""
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return []
        logits = self.runner.execute(self._plan(scheduled))
        return self._postprocess(scheduled, logits)

    def _plan(self, scheduled: SchedulerOutput) -> StepPlan:
        chunks = [
            SeqChunk(tuple(c.request.token_ids[c.start : c.start + c.num_tokens]), c.start, c.pages)
            for c in scheduled.chunks
        ]
        page_size = self.kv.page_size if self.kv is not None else None
        return build_plan(chunks, page_size, self.runner.device)

    def _postprocess(self, scheduled: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        self._steps += 1
        self._tokens_computed += scheduled.num_tokens
        outputs: list[RequestOutput] = []
        for row, chunk in enumerate(scheduled.chunks):
            request = chunk.request
            self._count_prefill(chunk)
            if self.kv is not None:
                request.num_computed_tokens = chunk.start + chunk.num_tokens
                self._commit(request, chunk)
            if chunk.completes_sequence:
                outputs.append(self._append_token(request, logits[row]))
        if self.kv is not None:
            self._peak_pages = max(self._peak_pages, self.kv.stats().pages_in_use)
        return outputs

    def _count_prefill(self, chunk: ScheduledChunk) -> None:
        prompt_len = len(chunk.request.prompt_token_ids)
        end = min(chunk.start + chunk.num_tokens, prompt_len)
        self._prefill_tokens_computed += max(0, end - chunk.start)

    def _commit(self, request: Request, chunk: ScheduledChunk) -> None:
        """Publish pages that this step filled: their K/V are now written (KVM-021)."""
        kv = self.kv
        if kv is None or request.seq_id is None:
            return
        size = kv.page_size
        end = chunk.start + chunk.num_tokens
        if end // size > chunk.start // size:
            kv.commit(request.seq_id, request.token_ids[:end])

    def _append_token(self, request: Request, logits: torch.Tensor) -> RequestOutput:
        params = request.params
        token = sample(logits, params, request.generator)
        now = time.perf_counter()
        if request.first_token_time is None:
            request.first_token_time = now
        request.token_ids.append(token)
        if request.logprobs is not None and params.logprobs is not None:
            request.logprobs.append(token_logprobs(logits, token, params.logprobs))
        reason = self._stop_reason(request, token)
        new_text = ""
        text = self._texts.get(request.request_id)
        if text is not None:
            new_text, stopped = text.update(request.output_token_ids, final=reason is not None)
            if stopped and reason is None:
                reason = FinishReason.STOP
                rest, _ = text.update(request.output_token_ids, final=True)
                new_text += rest
            request.text = text.text
        if reason is not None:
            self._finish(request, reason)
        return self._output(request, (token,), new_text)

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if not params.ignore_eos and token in self.eos_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.perf_counter()
        del self._requests[request.request_id]
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
        )

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

    def stats(self) -> EngineStats:
        """Engine-wide counters (ENG-050)."""
        kv = self.kv.stats() if self.kv is not None else None
        return EngineStats(
            num_pages=kv.num_pages if kv else 0,
            pages_in_use=kv.pages_in_use if kv else 0,
            pages_free=kv.pages_free if kv else 0,
            pages_cached=kv.pages_cached if kv else 0,
            peak_pages_in_use=self._peak_pages,
            query_tokens=kv.query_tokens if kv else 0,
            hit_tokens=kv.hit_tokens if kv else 0,
            prefill_tokens_computed=self._prefill_tokens_computed,
            tokens_computed=self._tokens_computed,
            steps=self._steps,
            preemptions=self.scheduler.num_preemptions,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
        )

    def check_invariants(self) -> None:
        """The KVManager's invariants, plus: the pages in use are exactly those of running
        requests, and a running request's reservation covers what it has computed."""
        if self.kv is None:
            return
        self.kv.check_invariants()
        held: set[int] = set()
        for request in self.scheduler.running:
            if request.seq_id is None:
                raise InvariantViolation(f"running request {request.request_id} holds no pages")
            table = self.kv.page_table(request.seq_id)
            if table.num_tokens < request.num_computed_tokens:
                raise InvariantViolation(
                    f"request {request.request_id} computed {request.num_computed_tokens} "
                    f"positions but reserved {table.num_tokens}"
                )
            held.update(table.pages)
        in_use = self.kv.stats().pages_in_use
        if in_use != len(held):
            raise InvariantViolation(f"{in_use} pages in use but running requests hold {len(held)}")
