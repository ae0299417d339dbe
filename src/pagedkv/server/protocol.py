"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Only the fields pagedkv implements are declared; unknown request fields (``user``,
``frequency_penalty``, ...) are accepted and ignored, as OpenAI clients send some by default.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk carrying the usage."""

    include_usage: bool = False


class SamplingFields(_Request):
    """Sampling fields shared by both endpoints; ranges are checked by ``SamplingParams``."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``.

    Attributes:
        prompt: one text, a list of texts, one list of token ids or a list of them; a list
            yields one choice per prompt, indexed in order.
        max_tokens: most tokens generated per prompt (default 16, as OpenAI's).
        logprobs: also return the log-probabilities of this many most likely tokens per
            position (``0`` for the chosen token's only).
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)


class TextPart(_Request):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One message of a conversation; content given as parts is joined into one text."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``.

    Attributes:
        messages: the conversation, rendered through the model's chat template.
        max_tokens, max_completion_tokens: most tokens generated; when both are absent, up to
            the rest of the model's context.
        logprobs: return the chosen tokens' log-probabilities.
        top_logprobs: with ``logprobs``, also the this many most likely tokens per position.
        chat_template_kwargs: further variables of the chat template, e.g.
            ``{"enable_thinking": false}`` for Qwen3; a key the template does not read is
            refused with 400.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


# -- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens served from the prefix cache."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of a whole response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    """The reply; with a reasoning parser, its thinking is in ``reasoning_content`` (``None``
    when it did not think) and ``content`` is ``None`` when nothing followed the thinking."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedkv"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
