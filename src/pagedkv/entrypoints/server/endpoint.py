"""What one OpenAI generation endpoint adds to the request path both share.

``/v1/completions`` and ``/v1/chat/completions`` are answered by one path
(:mod:`pagedkv.entrypoints.server.generate`): check the request, submit its prompts, then
either collect every output into one response body or stream chunks as server-sent events.
They differ in two things only, which an :class:`Endpoint` supplies:

- how a request becomes prompts and sampling parameters (texts or token ids, with ``echo``;
  or a conversation through the chat template), see :class:`Submission`;
- how a choice is shaped (``text`` in ``text_completion`` objects; ``message`` or ``delta`` in
  ``chat.completion`` and ``chat.completion.chunk`` objects), see :class:`ChoiceShape`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from pydantic import BaseModel

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.entrypoints.server.async_engine import PromptInput, StreamItem
from pagedkv.entrypoints.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    SamplingFields,
    Usage,
)
from pagedkv.entrypoints.server.state import ServerState

BodyT_contra = TypeVar("BodyT_contra", bound=SamplingFields, contravariant=True)


@dataclass(frozen=True, slots=True)
class Submission:
    """What a request asks the engine for.

    Attributes:
        prompts: the request's prompts, in order (at least one).
        params: sampling parameters shared by every prompt.
        token_texts: decode the token ids of logprobs entries and prompts (see
            :class:`~pagedkv.entrypoints.server.async_engine.StreamItem`).
        fill_context: ``params.max_tokens`` becomes the positions left in the model's context
            after each prompt.
        constraint_field: the request field ``params.structured_outputs`` came from, named
            when the engine cannot compile it (SRV-131).
    """

    prompts: list[PromptInput]
    params: SamplingParams
    token_texts: bool
    fill_context: bool = False
    constraint_field: str | None = None


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The fields every body and chunk of one response starts with.

    Attributes:
        id: the response's id (``cmpl-...``, ``chatcmpl-...``).
        created: Unix time (seconds) the request was accepted.
        model: the served model's name.
    """

    id: str
    created: int
    model: str

    def completion(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionResponse:
        """A ``text_completion`` body, or chunk, of this response."""
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def chat_chunk(
        self, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        """A ``chat.completion.chunk`` of this response."""
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )


@dataclass(slots=True)
class Collected:
    """The final output and the token texts of each prompt of a non-streamed response.

    Attributes:
        outputs: prompt index -> its latest (at the end, final) output.
        texts: prompt index -> the text of every token id its outputs carried.
    """

    outputs: dict[int, RequestOutput] = field(default_factory=dict)
    texts: dict[int, dict[int, str]] = field(default_factory=dict)

    def add(self, item: StreamItem) -> None:
        self.outputs[item.index] = item.output
        self.texts.setdefault(item.index, {}).update(item.token_texts)

    def ordered(self) -> list[tuple[int, RequestOutput, Mapping[int, str]]]:
        """``(index, final output, token texts)`` in prompt order."""
        return [(i, self.outputs[i], self.texts.get(i, {})) for i in sorted(self.outputs)]


class ChunkShaper(Protocol):
    """The chunks of one streamed response, in order; may keep state from chunk to chunk
    (characters sent, a reasoning splitter per choice)."""

    def opening(self) -> BaseModel | None:
        """The chunk sent before any output, or ``None`` for none."""

    def delta(
        self, item: StreamItem, completion: CompletionOutput, ending: bool
    ) -> BaseModel | None:
        """The chunk of what this step added to one completion of ``item``'s prompt, or
        ``None`` when there is nothing to send; ``ending``: the completion finished in this
        step (its finish reason goes out now)."""

    def closing(self, usage: Usage) -> BaseModel:
        """The last chunk, carrying the usage of the whole response (``include_usage``)."""


class ChoiceShape(Protocol):
    """How the choices of one request are shaped, whole or streamed."""

    def response(self, head: ResponseHead, collected: Collected) -> BaseModel:
        """The body of the non-streamed response from every prompt's final output."""

    def chunks(self, head: ResponseHead) -> ChunkShaper:
        """A fresh shaper of the streamed response's chunks."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request: what to submit and how its choices will be shaped."""

    submission: Submission
    shape: ChoiceShape


class Endpoint(Protocol[BodyT_contra]):
    """One generation endpoint: how its requests are prepared and named.

    Attributes:
        id_prefix: the prefix of its response ids (``cmpl``, ``chatcmpl``).
    """

    @property
    def id_prefix(self) -> str: ...

    async def prepare(self, body: BodyT_contra, state: ServerState) -> Prepared:
        """Check what only this endpoint checks, and build its submission and choice shape.

        Raises:
            APIError, InvalidRequest: the request is refused (answered 4xx).
        """
