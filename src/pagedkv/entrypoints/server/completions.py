"""``/v1/completions``: prompts are texts or token ids, a choice is a ``text``.

With ``echo`` a choice's text starts with its prompt (and its legacy logprobs with the
prompt's tokens); the choices of a request are indexed prompt by prompt, ``n`` each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.entrypoints.server.async_engine import PromptInput, StreamItem
from pagedkv.entrypoints.server.endpoint import (
    Collected,
    Prepared,
    ResponseHead,
    Submission,
)
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.openai_format import (
    choice_index,
    completion_logprobs,
    completion_prompts,
    echo_logprobs,
    finish_reason,
    joined,
    new_logprobs,
    prompt_logprobs,
    sampling_params,
    usage,
)
from pagedkv.entrypoints.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from pagedkv.entrypoints.server.state import ServerState
from pagedkv.entrypoints.server.structured import request_constraint

#: OpenAI's default ``max_tokens`` for completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class Completions:
    """The ``/v1/completions`` endpoint (see :class:`~.endpoint.Endpoint`)."""

    id_prefix = "cmpl"

    async def prepare(self, body: CompletionRequest, state: ServerState) -> Prepared:
        """Prompts as sent; ``max_tokens`` defaults to the model's, else OpenAI's 16; with
        ``echo`` and ``logprobs`` the prompt's tokens get log-probabilities too."""
        defaults = state.engine.generation_defaults
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = defaults.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        want_logprobs = body.logprobs is not None
        asked_prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:  # the echoed tokens carry logprobs too
            asked_prompt_logprobs = max(asked_prompt_logprobs or 0, body.logprobs)
        constraint = request_constraint(body)
        params = sampling_params(
            body,
            defaults,
            max_tokens=max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=asked_prompt_logprobs,
            structured_outputs=None if constraint is None else constraint.params,
        )
        prompts = completion_prompts(body.prompt)
        echoed = await echo_texts(state, prompts) if body.echo else None
        submission = Submission(
            prompts,
            params,
            token_texts=want_logprobs or asked_prompt_logprobs is not None,
            constraint_field=None if constraint is None else constraint.field,
        )
        shape = CompletionShape(
            n=params.n,
            logprobs=want_logprobs,
            echo=echoed,
            prompt_logprobs=body.prompt_logprobs is not None,
        )
        return Prepared(submission, shape)


async def echo_texts(state: ServerState, prompts: list[PromptInput]) -> list[str]:
    """The text each prompt echoes: a text prompt as sent, token ids decoded."""
    texts = []
    for prompt in prompts:
        if isinstance(prompt, str):
            texts.append(prompt)
        elif isinstance(prompt, tuple):
            texts.append((await state.engine.detokenize(prompt))[0])
        else:
            raise APIError(400, "echo applies to completion prompts only", param="echo")
    return texts


@dataclass(frozen=True, slots=True)
class CompletionShape:
    """How a completions request's choices are shaped.

    Attributes:
        n: completions per prompt.
        logprobs: include the legacy logprobs.
        echo: per prompt, the text its choices begin with; ``None`` without ``echo``.
        prompt_logprobs: include vLLM's ``prompt_logprobs``.
    """

    n: int
    logprobs: bool
    echo: list[str] | None
    prompt_logprobs: bool

    def response(self, head: ResponseHead, collected: Collected) -> CompletionResponse:
        """Every completion of every prompt, whole, in choice order."""
        choices = [
            self.choice(index, output, completion, texts, first=True, final=True)
            for index, output, texts in collected.ordered()
            for completion in output.outputs
        ]
        return head.completion(choices, usage(collected.outputs.values()))

    def chunks(self, head: ResponseHead) -> CompletionChunks:
        return CompletionChunks(self, head)

    def choice(
        self,
        prompt_index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        texts: Mapping[int, str],
        *,
        first: bool,
        final: bool,
        offset: int = 0,
    ) -> CompletionChoice:
        """One choice: the whole completion (``final``) or this step's delta of it; ``first``
        marks the choice's first chunk, which carries the echoed prompt and the prompt
        log-probabilities. ``offset``: characters of the choice already sent."""
        prefix = self.echo[prompt_index] if self.echo is not None and first else ""
        done = completion.finished() and (final or bool(completion.new_token_ids))
        result = CompletionChoice(
            index=choice_index(prompt_index, self.n, completion),
            text=prefix + (completion.text if final else completion.new_text),
            finish_reason=finish_reason(completion) if done else None,
            stop_reason=completion.stop_reason if done else None,
        )
        if self.logprobs:
            entries = completion.logprobs or () if final else new_logprobs(completion)
            logprobs = completion_logprobs(entries, texts, offset + len(prefix))
            if prefix:
                echoed = echo_logprobs(output.prompt_token_ids, output.prompt_logprobs, texts)
                logprobs = joined(echoed, logprobs)
            result.logprobs = logprobs
        if self.prompt_logprobs and first:
            result.prompt_logprobs = prompt_logprobs(output, texts)
        return result


@dataclass(slots=True)
class CompletionChunks:
    """``text_completion`` chunks: one per choice a step added to (or finished); the first of
    a choice carries its echoed prompt and prompt log-probabilities.

    Attributes:
        shape: how the choices are shaped.
        head: the response's id, creation time and model.
        sent: choice index -> characters of its text sent so far.
        texts: prompt index -> the text of every token id its outputs carried so far.
    """

    shape: CompletionShape
    head: ResponseHead
    sent: dict[int, int] = field(default_factory=dict)
    texts: dict[int, dict[int, str]] = field(default_factory=dict)

    def opening(self) -> None:
        return None

    def delta(
        self, item: StreamItem, completion: CompletionOutput, ending: bool
    ) -> CompletionResponse | None:
        shape = self.shape
        known = self.texts.setdefault(item.index, {})
        known.update(item.token_texts)
        index = choice_index(item.index, shape.n, completion)
        first = index not in self.sent
        entries = new_logprobs(completion) if shape.logprobs else ()
        opening = first and (shape.echo is not None or shape.prompt_logprobs)
        if not (completion.new_text or ending or entries or opening):
            return None
        offset = self.sent.get(index, 0)
        choice = shape.choice(
            item.index, item.output, completion, known, first=first, final=False, offset=offset
        )
        self.sent[index] = offset + len(choice.text)
        return self.head.completion([choice])

    def closing(self, usage: Usage) -> CompletionResponse:
        return self.head.completion([], usage)
