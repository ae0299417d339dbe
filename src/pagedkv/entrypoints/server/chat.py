"""``/v1/chat/completions``: the prompt is a conversation rendered through the model's chat
template, a choice is the assistant's ``message`` (whole) or ``delta`` (streamed).

With a reasoning parser, the reply's thinking goes to ``reasoning_content`` apart from its
``content``, whole or delta by delta. With ``tools``, the reply's tool calls go to
``tool_calls`` (see :mod:`~pagedkv.entrypoints.server.tool_calls`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.engine.outputs import CompletionOutput
from pagedkv.entrypoints.server.async_engine import ChatPrompt, StreamItem
from pagedkv.entrypoints.server.endpoint import (
    Collected,
    Prepared,
    ResponseHead,
    Submission,
)
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.openai_format import (
    assistant_message,
    chat_logprobs,
    finish_reason,
    new_logprobs,
    prompt_logprobs,
    sampling_params,
    usage,
)
from pagedkv.entrypoints.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Delta,
    Usage,
)
from pagedkv.entrypoints.server.reasoning import ReasoningParser, ReasoningSplitter
from pagedkv.entrypoints.server.state import ServerState
from pagedkv.entrypoints.server.structured import request_constraint
from pagedkv.entrypoints.server.tool_calls import ToolCallStream, ToolMode, tool_mode


class Chat:
    """The ``/v1/chat/completions`` endpoint (see :class:`~.endpoint.Endpoint`)."""

    id_prefix = "chatcmpl"

    async def prepare(self, body: ChatCompletionRequest, state: ServerState) -> Prepared:
        """One prompt, the conversation; ``max_completion_tokens``, else ``max_tokens``, else
        the model's default, else the rest of the context after the prompt.

        Raises:
            APIError: ``top_logprobs`` without ``logprobs`` (400).
        """
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(
                400,
                "top_logprobs needs logprobs: true",
                param="top_logprobs",
                code="invalid_sampling_params",
            )
        defaults = state.engine.generation_defaults
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = defaults.max_tokens
        top = body.top_logprobs or 0
        tools, tool_constraint = tool_mode(body, state.auto_tool_choice)
        constraint = request_constraint(body)
        if tool_constraint is not None:
            if constraint is not None:
                raise APIError(
                    400,
                    f"{constraint.field} cannot be given with tool_choice "
                    f"{body.tool_choice!r}: the tool choice constrains the reply itself",
                    param=constraint.field,
                    code="invalid_structured_outputs",
                )
            constraint = tool_constraint
        params = sampling_params(
            body,
            defaults,
            max_tokens=1 if max_tokens is None else max_tokens,
            logprobs=top if body.logprobs else None,
            structured_outputs=None if constraint is None else constraint.params,
        )
        prompt = ChatPrompt(
            tuple(m.template_message() for m in body.messages),
            body.chat_template_kwargs or {},
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=tuple(t.model_dump(exclude_none=True) for t in body.tools or ()),
        )
        submission = Submission(
            [prompt],
            params,
            token_texts=body.logprobs or body.prompt_logprobs is not None,
            fill_context=max_tokens is None,
            constraint_field=None if constraint is None else constraint.field,
        )
        shape = ChatShape(
            n=params.n, logprobs=body.logprobs, reasoning=state.reasoning, tools=tools
        )
        return Prepared(submission, shape)


@dataclass(frozen=True, slots=True)
class ChatShape:
    """How a chat request's choices are shaped.

    Attributes:
        n: completions of the conversation.
        logprobs: include the chosen tokens' log-probabilities.
        reasoning: the parser splitting thinking from content, ``None`` for none.
        tools: how tool calls are read from the reply, ``None`` without tools.
    """

    n: int
    logprobs: bool
    reasoning: ReasoningParser | None
    tools: ToolMode | None = None

    def message(self, completion: CompletionOutput, prompt: Sequence[int]) -> AssistantMessage:
        """The whole reply, its tool calls read out of its content (SRV-132)."""
        message = assistant_message(completion, prompt, self.reasoning)
        if self.tools is not None and message.content is not None:
            message.content, message.tool_calls = self.tools.parse(message.content)
        return message

    def response(self, head: ResponseHead, collected: Collected) -> ChatCompletionResponse:
        """Every completion as a whole assistant message; the prompt's log-probabilities once,
        beside the choices."""
        ((_, output, texts),) = collected.ordered()
        choices = []
        for completion in output.outputs:
            message = self.message(completion, output.prompt_token_ids)
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=message,
                    logprobs=chat_logprobs(completion.logprobs or (), texts)
                    if self.logprobs
                    else None,
                    finish_reason="tool_calls" if message.tool_calls else finish_reason(completion),
                    stop_reason=completion.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=head.id,
            created=head.created,
            model=head.model,
            choices=choices,
            usage=usage(collected.outputs.values()),
            prompt_logprobs=prompt_logprobs(output, texts),
        )

    def chunks(self, head: ResponseHead) -> ChatChunks:
        return ChatChunks(self, head)


@dataclass(slots=True)
class ChatChunks:
    """``chat.completion.chunk`` events: the assistant role of every choice first, then
    content deltas (with a reasoning parser, reasoning deltas apart from content ones), each
    choice's finish reason with its last delta.

    Attributes:
        shape: how the choices are shaped.
        head: the response's id, creation time and model.
        splitters: completion index -> its reasoning splitter (with a reasoning parser).
        calls: completion index -> its tool-call stream (with tools).
    """

    shape: ChatShape
    head: ResponseHead
    splitters: dict[int, ReasoningSplitter] = field(default_factory=dict)
    calls: dict[int, ToolCallStream] = field(default_factory=dict)

    def opening(self) -> ChatCompletionChunk:
        roles = [
            ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))
            for i in range(self.shape.n)
        ]
        return self.head.chat_chunk(roles)

    def delta(
        self, item: StreamItem, completion: CompletionOutput, ending: bool
    ) -> ChatCompletionChunk | None:
        shape = self.shape
        entries = new_logprobs(completion) if shape.logprobs else ()
        if shape.reasoning is None:
            delta = Delta(content=completion.new_text)
        else:
            splitter = self.splitters.get(completion.index)
            if splitter is None:
                splitter = shape.reasoning.splitter(item.output.prompt_token_ids)
                self.splitters[completion.index] = splitter
            delta = _split_delta(splitter, completion.new_text, ending)
        called = False
        if shape.tools is not None:
            stream = self.calls.get(completion.index)
            if stream is None:
                stream = self.calls[completion.index] = shape.tools.streamer()
            content, calls = stream.feed(delta.content or "", ending)
            delta.content, delta.tool_calls = content or None, calls or None
            called = stream.called
        if not (delta.content or delta.reasoning_content or delta.tool_calls or ending or entries):
            return None
        reason = finish_reason(completion)
        choice = ChatChunkChoice(
            index=completion.index,
            delta=delta,
            finish_reason=("tool_calls" if called else reason) if ending else None,
            stop_reason=completion.stop_reason if ending else None,
        )
        if shape.logprobs:
            choice.logprobs = chat_logprobs(entries, item.token_texts)
        return self.head.chat_chunk([choice])

    def closing(self, usage: Usage) -> ChatCompletionChunk:
        return self.head.chat_chunk([], usage)


def _split_delta(splitter: ReasoningSplitter, new_text: str, finished: bool) -> Delta:
    """The delta of one step's new text of a completion, split into reasoning and content
    (held-back text is released when the completion finishes)."""
    reasoning, content = splitter.feed(new_text)
    if finished:
        tail_reasoning, tail_content = splitter.finish()
        reasoning, content = reasoning + tail_reasoning, content + tail_content
    return Delta(content=content or None, reasoning_content=reasoning or None)
