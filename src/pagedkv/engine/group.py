"""A request as its caller sees it: one prompt, its ``n`` completions, and their text.

The scheduler sees sequences (:class:`~pagedkv.engine.request.Request`); a request with ``n`` or
``best_of`` above 1 runs several, forked from the first once its prompt is computed (ENG-047).
The group gathers them back: it detokenizes each sequence incrementally, keeps the prompt's
log-probabilities, and builds the :class:`~pagedkv.engine.outputs.RequestOutput` of a step, with
``best_of`` choosing the ``n`` completions of highest cumulative log-probability at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.outputs import (
    CompletionOutput,
    FinishReason,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from pagedkv.engine.params import OutputKind, SamplingParams
from pagedkv.engine.request import Request
from pagedkv.engine.sampler import prompt_logprobs


@dataclass(eq=False)
class RequestGroup:
    """The sequences of one request and what its outputs need.

    Attributes:
        request_id: the id ``add_request`` returned, shared by every sequence.
        prompt: the prompt's text when given as text.
        sequences: by index; the first computes the prompt, the others are its forks.
        detokenizers: one per sequence, ``None`` without a tokenizer.
        prompt_logprobs: per prompt position (``None`` at 0), when asked for.
        prompt_logprobs_done: prompt positions filled so far (1 + the last filled).
        reported: output tokens of each sequence already reported in an output.
        decoded: output tokens of each sequence already detokenized.
        decode_token: one token's text, for each ``Logprob``'s ``decoded_token``; ``None``
            without a tokenizer.
        logprob_dicts: each sequence's log-probabilities in vLLM's shape, built once per
            position (ENG-186).
    """

    request_id: str
    prompt: str | None
    sequences: list[Request]
    detokenizers: list[IncrementalDetokenizer] | None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_done: int = 1
    reported: list[int] = field(default_factory=list)
    decoded: list[int] = field(default_factory=list)
    decode_token: Callable[[int], str] | None = None
    logprob_dicts: list[list[PositionLogprobs]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reported = [0] * len(self.sequences)
        self.decoded = [0] * len(self.sequences)
        self.logprob_dicts = [[] for _ in self.sequences]

    def _logprobs(self, sequence: Request) -> list[PositionLogprobs] | None:
        """The sequence's log-probabilities so far, in vLLM's shape (a fresh list)."""
        if sequence.logprobs is None:
            return None
        built = self.logprob_dicts[sequence.index]
        for entry in sequence.logprobs[len(built) :]:
            built.append(PositionLogprobs(entry, self.decode_token))
        return list(built)

    @property
    def params(self) -> SamplingParams:
        return self.sequences[0].params

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.sequences[0].prompt_token_ids

    @property
    def finished(self) -> bool:
        """Whether every sequence has ended."""
        return all(s.finished for s in self.sequences)

    @property
    def error(self) -> str | None:
        """Why the request failed: the error of its first sequence that failed (ENG-070)."""
        return next((s.error for s in self.sequences if s.error is not None), None)

    @property
    def hidden(self) -> bool:
        """Whether outputs wait for the end: asked ``final_only`` (ENG-157), or ``best_of``
        above ``n``, which chooses completions only once all are done, so none is shown
        before. Nothing is reported before the end, so the end's deltas are everything."""
        waits = (
            self.params.output_kind is OutputKind.FINAL_ONLY
            or self.params.num_sequences > self.params.n
        )
        return waits and not self.finished

    # -- text -------------------------------------------------------------------------------

    def detokenize(self, sequence: Request) -> str | None:
        """Feed the sequence's new tokens to its detokenizer; the stop string they completed,
        if any. A sequence a token has just stopped (EOS, stop token) leaves that token's
        text out (ENG-090)."""
        if self.detokenizers is None:
            return None
        index = sequence.index
        output = sequence.output_token_ids
        new, self.decoded[index] = output[self.decoded[index] :], len(output)
        stop_token = sequence.finish_reason is FinishReason.STOP
        return self.detokenizers[index].update(new, stop_token=stop_token)

    def add_prompt_logprobs(self, start: int, logits: torch.Tensor) -> None:
        """Keep the log-probabilities of the prompt tokens after positions ``start ..``
        (``logits`` row ``i`` is position ``start + i``, predicting the next token), skipping
        those a recomputation already gave."""
        if self.prompt_logprobs is None:
            return
        prompt = self.prompt_token_ids
        first = max(self.prompt_logprobs_done, start + 1)
        last = min(
            start + logits.shape[0], len(prompt) - 1
        )  # the last row predicts no prompt token
        if first > last:
            return
        entries = prompt_logprobs(
            logits[first - 1 - start : last - start],
            prompt[first : last + 1],
            self.params.prompt_logprobs or 0,
        )
        self.prompt_logprobs[first : last + 1] = entries
        self.prompt_logprobs_done = last + 1

    # -- outputs ----------------------------------------------------------------------------

    def _returned(self) -> list[Request]:
        """The sequences shown, in index order; once ``best_of`` above ``n`` is done, the
        ``n`` of highest cumulative log-probability, best first."""
        if self.params.num_sequences > self.params.n and self.finished and self.error is None:
            ranked = sorted(self.sequences, key=lambda s: -s.cumulative_logprob)
            return ranked[: self.params.n]
        return list(self.sequences)

    def _completion(self, index: int, sequence: Request) -> CompletionOutput:
        """One sequence's completion; a failed one carries no new token or text (ENG-070)."""
        output = sequence.output_token_ids
        failed = sequence.finish_reason is FinishReason.ERROR
        new_ids = [] if failed else output[self.reported[sequence.index] :]
        self.reported[sequence.index] = len(output)
        text = new_text = ""
        if self.detokenizers is not None:
            detokenizer = self.detokenizers[sequence.index]
            new_text = "" if failed else detokenizer.release(sequence.finished)
            text = detokenizer.released
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(output),
            cumulative_logprob=sequence.cumulative_logprob,
            logprobs=self._logprobs(sequence),
            finish_reason=sequence.finish_reason,
            stop_reason=sequence.stop_reason,
            new_token_ids=list(new_ids),
            new_text=new_text,
        )

    def output(self) -> RequestOutput:
        """The request's output after a step (deltas since the previous output)."""
        shown = self._returned()
        done = self.prompt_logprobs is not None and self.prompt_logprobs_done >= len(
            self.prompt_token_ids
        )
        prompt_logprobs = None
        if done and self.prompt_logprobs:
            prompt_logprobs = [
                None if e is None else PositionLogprobs(e, self.decode_token)
                for e in self.prompt_logprobs
            ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            prompt_logprobs=prompt_logprobs,
            outputs=[self._completion(i, s) for i, s in enumerate(shown)],
            finished=self.finished,
            metrics=self.metrics(),
            error=self.error,
        )

    def metrics(self) -> RequestMetrics:
        """The first sequence's timings and counts; generated tokens and preemptions summed
        over every sequence, the end that of the last to finish."""
        first = self.sequences[0]
        ends = [s.finished_time for s in self.sequences]
        return RequestMetrics(
            arrival_time=first.arrival_time,
            first_token_time=first.first_token_time,
            finished_time=None if None in ends else max(e for e in ends if e is not None),
            prompt_tokens=len(first.prompt_token_ids),
            cached_tokens=first.cached_tokens or 0,
            generated_tokens=sum(s.num_output_tokens for s in self.sequences),
            preemptions=sum(s.preemptions for s in self.sequences),
            first_scheduled_time=first.first_scheduled_time,
        )
