"""The engine: each step is schedule → plan → execute → sample → update → detokenize.

The scheduler picks the work and builds its plan; the runner computes logits; the engine samples
the sequences the step completed; the scheduler applies the tokens (progress, commits, stop
conditions, frees); the engine turns them into text and outputs. The engine never touches the
KVManager or a request's progress itself: the scheduler is their only owner.

One request's failure is that request's alone (ENG-070..072): an error in one row's sampling
or in one request's text fails that request and no other, and a step whose model run raises is
applied as nothing and tried again (the scheduler decides how often, and which request then
fails). ``step()`` never raises for either.

A runner that can run nothing more (:class:`~pagedkv.errors.RunnerFailed`: a tensor-parallel
worker died, TP-022) ends the engine instead: every unfinished request fails with the error,
and ``step()`` and ``add_request()`` raise it, then and from then on. :meth:`LLMEngine.close`
releases what the runner holds (a tensor-parallel runner's worker processes, TP-023).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import uuid
from collections.abc import Callable, Generator, Sequence

import torch

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.generation_config import GenerationDefaults
from pagedkv.engine.grammar import GrammarCompiler
from pagedkv.engine.group import RequestGroup
from pagedkv.engine.logit_summary import LogitSummary, RowSummary
from pagedkv.engine.outputs import EngineStats, FinishReason, RequestOutput, StepReport
from pagedkv.engine.params import InvalidSamplingParams, SamplingParams
from pagedkv.engine.prompts import PromptType, parse_prompt
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.sampler import Sampled, SampleRow, sample_batch, summarise
from pagedkv.engine.sched.factory import make_scheduler
from pagedkv.engine.sched.output import SampledToken, SampleError, SchedulerOutput
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequest, RequestTooLong, RunnerFailed, UnsupportedPriority
from pagedkv.interfaces import Closable, KVManager, StepRunner
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
        generation_defaults: the model's sampling defaults (``generation_config.json``),
            applied to a request given no SamplingParams (ENG-080).

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
        generation_defaults: GenerationDefaults | None = None,
    ) -> None:
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer
        self.generation_defaults = generation_defaults or GenerationDefaults()
        limit = config.max_model_len
        if runner.max_positions is not None:  # never past what the model was trained for
            limit = min(limit, runner.max_positions)
        self.scheduler = make_scheduler(config, kv_manager, eos_ids=eos_ids, max_model_len=limit)
        self.max_model_len = self.scheduler.max_model_len
        self._requests: dict[str, RequestGroup] = {}
        self._observers: list[StepObserver] = []
        self._ids = itertools.count()
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._steps = 0
        self._tokens_computed = 0
        self._prefill_tokens_computed = 0
        self._peak_pages = 0
        self._failure: RunnerFailed | None = None
        # Greedy tokens and chosen logprobs without a float32 copy of the logits (ENG-158);
        # where the kernel cannot be built, the sampler's torch path does it all.
        summary = LogitSummary.build()
        self._logit_summary = summary if isinstance(summary, LogitSummary) else None
        # Built on the first constrained request: wrapping the tokenizer takes a moment.
        self._grammars: GrammarCompiler | None = None

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; returns its id. Raises a typed error, queuing nothing, if it is
        invalid or could never fit (ENG-033).

        ``priority`` orders it under the ``priority`` scheduling policy (lower first); under
        ``fcfs`` a value other than 0 is refused, as vLLM does (ENG-189). ``max_tokens=None``
        means up to the context limit (ENG-187).

        ``prompt`` is text, token ids, or a vLLM prompt dict (ENG-062). Without ``params`` the
        model's generation defaults apply (ENG-080).
        """
        if self._failure is not None:
            raise self._failure
        params = params or self.generation_defaults.sampling_params()
        parsed = parse_prompt(prompt)
        if parsed.cache_salt is not None:
            if cache_salt is not None and cache_salt != parsed.cache_salt:
                raise InvalidRequest("the prompt's cache_salt differs from the cache_salt given")
            cache_salt = parsed.cache_salt
        prompt_ids = self._prompt_ids(parsed.text, parsed.token_ids)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise UnsupportedPriority(
                f"priority={priority} needs the priority scheduling policy; this engine "
                f"schedules {self.config.scheduling_policy}"
            )
        if params.max_tokens is None:
            left = max(1, self.max_model_len - len(prompt_ids))
            params = dataclasses.replace(
                params, max_tokens=left, min_tokens=min(params.min_tokens, left)
            )
        total = len(prompt_ids) + params.token_limit
        if total > self.max_model_len:
            raise RequestTooLong(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} = {total} "
                f"exceeds the {self.max_model_len} positions one sequence may hold"
            )
        self._check_params(params)
        grammar = self._compile(params)
        sequences = self._sequences(request_id, prompt_ids, params, cache_salt)
        if grammar is not None:
            compiler = self._grammar_compiler()
            for sequence in sequences:  # each sample its own matcher (ENG-192)
                sequence.grammar = compiler.matcher(grammar)
        detokenizers = None
        if self.tokenizer is not None and params.detokenize:  # detokenize=False: no text
            tokenizer = self.tokenizer
            skip = params.skip_special_tokens
            detokenizers = [
                IncrementalDetokenizer(
                    tokenizer.incremental_decoder(skip_special_tokens=skip), params
                )
                for _ in sequences
            ]
        group = RequestGroup(request_id, parsed.text, sequences, detokenizers)
        if self.tokenizer is not None:
            group.decode_token = self._token_text
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_ids)
        self._requests[request_id] = group
        for sequence in sequences:
            sequence.priority = priority
        self.scheduler.add(sequences[0])
        return request_id

    def _token_text(self, token_id: int) -> str:
        """One token's text, special tokens kept (a ``Logprob``'s ``decoded_token``)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: it needs the engine's limits."""
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer")
        if params.num_sequences > self.scheduler.config.max_num_seqs:
            raise InvalidSamplingParams(
                f"{params.num_sequences} sequences (n, best_of) exceed max_num_seqs="
                f"{self.scheduler.config.max_num_seqs}"
            )
        vocab = self.runner.vocab_size
        outside = [t for t, _ in params.bias if t >= vocab]
        if outside:
            raise InvalidSamplingParams(
                f"logit_bias names token ids {outside[:5]} outside the vocabulary of {vocab}"
            )

    def _grammar_compiler(self) -> GrammarCompiler:
        """This engine's grammar compiler, built on first use.

        Raises:
            InvalidRequest: the engine has no tokenizer.
        """
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidRequest("structured outputs need a model directory with a tokenizer")
            eos = set(self.scheduler.eos_ids)
            if self.tokenizer.eos_token_id is not None:
                eos.add(self.tokenizer.eos_token_id)
            self._grammars = GrammarCompiler(
                self.tokenizer.tokenizer_json(), self.runner.vocab_size, sorted(eos)
            )
        return self._grammars

    def _compile(self, params: SamplingParams) -> str | None:
        """The compiled grammar of ``params``' structured outputs, ``None`` without any.

        Raises:
            InvalidStructuredOutputs: the constraint cannot be compiled (ENG-194).
        """
        if params.structured_outputs is None:
            return None
        return self._grammar_compiler().compile(params.structured_outputs)

    def _sequences(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None,
    ) -> list[Request]:
        """The request's sequences: the first queued, the others its unborn forks (ENG-047).

        Each samples with its own generator, on the runner's device (ENG-218): seeded
        ``seed + index``, as vLLM seeds the children of a parallel-sampling request. A request
        asking for prompt log-probabilities computes its whole prompt: it takes a salt of its
        own and publishes nothing (ENG-049).
        """
        publish = params.prompt_logprobs is None
        if not publish:
            cache_salt = f"\x00prompt-logprobs {uuid.uuid4().hex}"
        arrival = time.perf_counter()
        sequences = []
        for index in range(params.num_sequences):
            generator = None
            if not params.greedy:
                seed = params.seed
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source).item())
                else:
                    seed = (seed + index) % 2**64
                generator = torch.Generator(device=self.runner.device).manual_seed(seed)
            sequences.append(
                Request(
                    request_id=request_id,
                    prompt_token_ids=tuple(prompt_ids),
                    params=params,
                    cache_salt=cache_salt,
                    arrival_time=arrival,
                    generator=generator,
                    logprobs=[] if params.logprobs is not None else None,
                    index=index,
                    publish=publish,
                    status=RequestStatus.WAITING if index == 0 else RequestStatus.UNBORN,
                )
            )
        sequences[0].forks = sequences[1:]
        return sequences

    def _prompt_ids(self, text: str | None, token_ids: Sequence[int] | None) -> list[int]:
        if text is not None:
            if self.tokenizer is None:
                raise InvalidRequest("a text prompt needs a model directory with a tokenizer")
            ids = self.tokenizer.encode(text)
        else:
            ids = list(token_ids or ())
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
        group = self._requests.get(request_id)
        if group is None:
            return None
        for sequence in group.sequences:
            if not sequence.finished:
                self.scheduler.finish(sequence, FinishReason.ABORT)
        self._forget(group)
        return group.output()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the outputs of the requests it advanced or failed
        (finish reason ``error``, ENG-070..072), a ``final_only`` one's only once it has ended
        (ENG-157).

        Raises:
            RunnerFailed: the runner can run no more steps (TP-022); the engine has ended.
        """
        if self._failure is not None:
            raise self._failure
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return []
        scheduled_at = time.perf_counter()
        try:
            plan = self.scheduler.build_plan(scheduled, self.runner.device)
            planned_at = time.perf_counter()
            logits = self._execute(plan, sum(c.num_logits for c in scheduled.chunks))
        except RunnerFailed as exc:  # nothing can run any more: the engine ends
            self._end(exc)
            raise
        except Exception as exc:  # the whole step failed: none of it is applied (ENG-071)
            failed = self.scheduler.update_from_failure(scheduled, _describe(exc))
            return self._outputs(failed)
        executed_at = time.perf_counter()
        sampled = self._sample(scheduled, logits)
        sampled_at = time.perf_counter()
        advanced = self.scheduler.update_from_output(scheduled, sampled)
        updated_at = time.perf_counter()
        outputs = self._outputs(advanced)
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

    def _end(self, failure: RunnerFailed) -> None:
        """End the engine: every unfinished request fails with ``failure`` (its pages freed),
        and every later step or request raises it."""
        self._failure = failure
        for group in list(self._requests.values()):
            for sequence in group.sequences:
                if not sequence.finished:
                    self.scheduler.fail(sequence, _describe(failure))
            self._forget(group)

    def close(self) -> None:
        """End the engine: unfinished requests fail, later steps and requests raise
        ``RunnerFailed``, and the runner releases what it holds (a tensor-parallel runner ends
        its workers, TP-023). Idempotent."""
        if self._failure is None:
            self._end(RunnerFailed("the engine was closed"))
        if isinstance(self.runner, Closable):
            self.runner.close()

    def _execute(self, plan: StepPlan, num_rows: int) -> torch.Tensor:
        """The runner's logits for ``plan``: ``num_rows`` rows, one per sequence plus the
        prompt positions whose log-probabilities were asked for."""
        logits = self.runner.execute(plan)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise InvalidRequest(
                f"the runner returned logits of shape {tuple(logits.shape)} for {num_rows} rows"
            )
        return logits

    def _sample(
        self, scheduled: SchedulerOutput, logits: torch.Tensor
    ) -> list[SampledToken | SampleError | None]:
        """The next token of every chunk that completes its sequence, and the first tokens
        of its forks, in one sampler call over the batch (ENG-048).

        ``logits`` holds ``chunk.num_logits`` rows per chunk, the last of them the chunk's
        sampling row; the others are prompt positions whose log-probabilities were asked for.
        A row whose sampling fails (NaN logits, or any error of its own) gets a
        :class:`SampleError`, the others their token (ENG-070).
        """
        rows: list[SampleRow] = []
        where: list[int] = []
        spans: list[tuple[int, int] | None] = []
        failed: dict[int, SampleError] = {}
        constrained: list[tuple[int, Request]] = []
        offset = 0
        for chunk in scheduled.chunks:
            last = offset + chunk.num_logits - 1
            if chunk.wants_prompt_logits:
                group = self._requests[chunk.request.request_id]
                group.add_prompt_logprobs(chunk.start, logits[offset : last + 1])
            offset = last + 1
            if not chunk.completes_sequence:
                spans.append(None)
                continue
            sequences = [chunk.request, *chunk.request.forks]
            spans.append((len(rows), len(sequences)))
            for sequence in sequences:
                if sequence.grammar is not None:
                    constrained.append((len(rows), sequence))
                rows.append(
                    SampleRow(
                        sequence.params,
                        sequence.generator,
                        sequence.prompt_token_ids,
                        sequence.output_token_ids,
                    )
                )
                where.append(last)
        if not rows:
            return [None] * len(spans)
        if constrained:
            self._grammar_masks(rows, constrained, failed)
        if where != list(range(logits.shape[0])):  # else every row is sampled, in order
            sampled_rows = torch.tensor(where, dtype=torch.int64, device=logits.device)
            logits = logits.index_select(0, sampled_rows)
        tokens = self._sample_rows(logits, rows)
        for index, error in failed.items():
            tokens[index] = error
        sampled: list[SampledToken | SampleError | None] = []
        for span in spans:
            if span is None:
                sampled.append(None)
                continue
            first, forks = tokens[span[0]], tuple(tokens[span[0] + 1 : span[0] + span[1]])
            if isinstance(first, SampleError) or not forks:
                sampled.append(first)  # a failed first sequence takes its forks with it
            else:
                sampled.append(dataclasses.replace(first, forks=forks))
        return sampled

    def _sample_rows(
        self, logits: torch.Tensor, rows: Sequence[SampleRow]
    ) -> list[SampledToken | SampleError]:
        """Every row in one batch; rows with NaN logits fail alone, and if the batch raises
        anyway, each row is sampled on its own so that only the rows that raise fail.

        Everything runs on the logits' device (ENG-216); what comes back to the host is each
        row's largest value (one ``[R]`` copy, to find the NaN rows) and the sampler's batched
        results (ENG-217)."""
        summary = summarise(logits, rows, self._logit_summary)
        # A row's largest value is NaN exactly when the row holds one: read from the summary
        # where the batch has one (ENG-158), else one pass of amax; no [R, vocab] mask.
        largest = summary.largest if summary is not None else logits.amax(dim=1)
        bad = {i for i, value in enumerate(largest.tolist()) if math.isnan(value)}
        good = [i for i in range(len(rows)) if i not in bad]
        out: list[SampledToken | SampleError] = [
            SampleError("sampling failed: the model's logits hold NaN") for _ in rows
        ]
        try:
            picked = logits
            if bad:
                index = torch.tensor(good, dtype=torch.int64, device=logits.device)
                picked = logits.index_select(0, index)
                summary = None  # the good rows' own is taken by the sampler
            results = self._sample_batch(
                picked, [rows[i] for i in good], self.scheduler.eos_ids, summary
            )
            for i, result in zip(good, results, strict=True):
                out[i] = _sampled_token(result, rows[i].params)
        except Exception:  # find the rows that raise: each fails alone
            for i in good:
                try:
                    (result,) = self._sample_batch(
                        logits[i : i + 1], [rows[i]], self.scheduler.eos_ids
                    )
                    out[i] = _sampled_token(result, rows[i].params)
                except Exception as exc:  # this row's own sampling
                    out[i] = SampleError(f"sampling failed: {_describe(exc)}")
        return out

    def _sample_batch(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRow],
        stop_ids: frozenset[int],
        summary: RowSummary | None = None,
    ) -> list[Sampled]:
        """:func:`~pagedkv.engine.sampler.sample_batch` with this engine's logit summary
        kernel (ENG-158), and the summary of these rows where it was taken already."""
        return sample_batch(logits, rows, stop_ids, self._logit_summary, summary)

    def _outputs(self, advanced: Sequence[Request]) -> list[RequestOutput]:
        """Detokenize the sequences that got a token (a stop string ends one here), then the
        output of each request they belong to, in the order of the first; a request whose
        completions ``best_of`` chooses shows none before it finishes.

        An error in a sequence's text or stop strings fails it (ENG-070), and a failed
        sequence fails its whole request: every other sequence of it ends with the same error.
        """
        groups: dict[str, RequestGroup] = {}
        for sequence in advanced:
            group = self._requests.get(sequence.request_id)
            if group is None:
                continue
            groups.setdefault(group.request_id, group)
            if sequence.finish_reason is FinishReason.ERROR:
                continue
            try:
                stop = group.detokenize(sequence)
            except Exception as exc:  # this request's own text: it fails alone
                self.scheduler.fail(sequence, f"detokenizing failed: {_describe(exc)}")
                continue
            if stop is not None:
                self.scheduler.finish(sequence, FinishReason.STOP)
                sequence.stop_reason = stop
            elif sequence.grammar is not None and not sequence.finished:
                self._grammar_end(sequence)
        outputs = []
        for group in groups.values():
            error = group.error
            if error is not None:
                for sequence in group.sequences:
                    if not sequence.finished:
                        self.scheduler.fail(sequence, error)
            if group.finished:
                self._forget(group)
            if not group.hidden:
                outputs.append(group.output())
        return outputs

    def _grammar_masks(
        self,
        rows: list[SampleRow],
        constrained: Sequence[tuple[int, Request]],
        failed: dict[int, SampleError],
    ) -> None:
        """Give each constrained row the mask of the tokens its grammar allows next, the
        matchers first brought to their sequences' output tokens (rebuilt from them where out
        of step, ENG-193), every mask in one parallel call (ENG-191). A row whose grammar
        fails gets a :class:`SampleError` in ``failed`` and samples unmasked (its token is
        then dropped)."""
        ready: list[tuple[int, Request]] = []
        for index, sequence in constrained:
            assert sequence.grammar is not None
            try:
                sequence.grammar.sync(sequence.output_token_ids)
                ready.append((index, sequence))
            except Exception as exc:  # this sequence's own grammar: it fails alone
                failed[index] = SampleError(f"structured outputs: {_describe(exc)}")
        if not ready:
            return
        try:
            masks = self._grammar_compiler().bitmasks([s.grammar for _, s in ready])  # type: ignore[misc]
        except Exception:  # find the rows whose grammar fails: each fails alone
            for index, sequence in ready:
                assert sequence.grammar is not None
                try:
                    rows[index] = dataclasses.replace(
                        rows[index], allowed=sequence.grammar.bitmask()
                    )
                except Exception as exc:
                    failed[index] = SampleError(f"structured outputs: {_describe(exc)}")
            return
        for k, (index, _) in enumerate(ready):
            rows[index] = dataclasses.replace(rows[index], allowed=masks[k])

    def _grammar_end(self, sequence: Request) -> None:
        """End a constrained sequence whose grammar can take no further token: its output is
        complete (ENG-195). A token the grammar refuses fails it."""
        assert sequence.grammar is not None
        try:
            sequence.grammar.sync(sequence.output_token_ids)
        except Exception as exc:
            self.scheduler.fail(sequence, f"structured outputs: {_describe(exc)}")
            return
        if sequence.grammar.stopped:
            self.scheduler.finish(sequence, FinishReason.STOP)

    def _count(self, scheduled: SchedulerOutput) -> None:
        self._steps += 1
        self._tokens_computed += scheduled.num_tokens
        self._prefill_tokens_computed += sum(c.num_prompt_tokens for c in scheduled.chunks)
        self._peak_pages = max(self._peak_pages, self.scheduler.kv_stats().pages_in_use)

    def _forget(self, group: RequestGroup) -> None:
        self._requests.pop(group.request_id, None)

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
        prompt: PromptType,
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


def _sampled_token(result: Sampled, params: SamplingParams) -> SampledToken:
    """The scheduler's view of one sampled row."""
    entry = result.token_logprobs() if params.logprobs is not None else None
    return SampledToken(result.token_id, entry, result.logprob)


def _describe(exc: Exception) -> str:
    """An error as a request's failure message: its type and message."""
    return f"{type(exc).__name__}: {exc}"
