"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Every declared request field is honored, or refused (SRV-100): a field made with
:func:`refused` is declared so that a request using it is answered 400 naming it, unless it
holds its neutral value (``tools: []``, ``response_format: {"type": "text"}``, ...). Unknown
request fields (``user``, ...) are accepted, as OpenAI clients send some by default, kept in
``model_extra`` and logged as ignored (see :mod:`pagedkv.entrypoints.server.request_checks`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedkv.errors import InvalidRequest

#: ``json_schema_extra`` key of a refused field: why it is refused.
REFUSED = "x-pagedkv-refused"
#: ``json_schema_extra`` key of a refused field's neutral values, which are accepted.
NEUTRAL = "x-pagedkv-neutral"
#: ``json_schema_extra`` key of a noted field: one OpenAI defines as naming the caller for its
#: records (``user``, ``metadata``, ...), which changes no output; it is logged with the
#: request's id (SRV-118).
NOTED = "x-pagedkv-noted"


def refused(reason: str, *neutral: Any) -> Any:
    """A declared field pagedkv does not implement: absent, ``None`` or one of ``neutral`` it
    is accepted (it changes nothing), anything else is answered 400 naming it."""
    return Field(default=None, json_schema_extra={REFUSED: reason, NEUTRAL: list(neutral)})


def noted(what: str) -> Any:
    """A declared field that changes no output by OpenAI's definition (it names the caller for
    their records): accepted and logged with the request's id."""
    return Field(default=None, json_schema_extra={NOTED: what})


#: Largest seed a request may give: ``torch.Generator`` takes unsigned 64-bit seeds.
MAX_SEED = 2**64 - 1

#: A token id as a tokenizer takes it (a 32-bit index).
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class _Request(BaseModel):
    # NaN and infinities (JSON's non-standard ``NaN``/``Infinity`` tokens, which Python's
    # reader accepts, or ``1e400``) are refused in every float field, naming it (SRV-105).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk carrying the usage."""

    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the schema the reply is held to (``strict`` accepted:
    the reply always matches the schema)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or
    ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs`` request field (see
    :class:`~pagedkv.engine.structured.StructuredOutputsParams`)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    structural_tag: Any = refused("structural tags are not supported")
    whitespace_pattern: Any = refused("whitespace patterns are not supported")
    disable_additional_properties: Any = refused(
        "the schema's own additionalProperties rule", False
    )


class SamplingFields(_Request):
    """Sampling fields shared by both endpoints; ranges are checked by ``SamplingParams``.

    Absent sampling fields take the model's generation-config defaults, then OpenAI's
    (SRV-103). ``n`` completions are returned per prompt, of ``best_of`` generated (the ``n``
    of highest cumulative log-probability); their prompt is computed once (SRV-006).

    Attributes:
        model: the served model's name; absent means the served model.
        seed: in ``[0, MAX_SEED]``, what ``torch.Generator`` takes.
        logit_bias: token id (as a string, as OpenAI sends it) to a bias; a finite bias
            outside ``[-100, 100]`` is clamped to it, as vLLM's server does (SRV-105).
        cache_salt: a prefix-cache namespace: KV pages are shared only between requests with
            the same salt (and, under per-key salting, the same API key). Use a long random
            secret per user or group that may see each other's prompts.
        priority: the request's priority under ``--scheduling-policy priority`` (lower first);
            under the default ``fcfs`` a value other than 0 is refused (SRV-118).
        request_id: names the response: its ``id`` is the endpoint's prefix then this, as
            vLLM's (``cmpl-ID``, ``chatcmpl-ID``).
        add_special_tokens: tokenize the prompt with the tokenizer's special tokens added (its
            BOS, for a tokenizer that has one); default ``false``.
    """

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = Field(default=None, min_length=1)
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    stop_token_ids: list[TokenId] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    include_stop_str_in_output: bool = False
    priority: int = 0
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    add_special_tokens: bool = False
    user: Any = noted("the end user's id")
    metadata: Any = noted("the caller's tags")
    safety_identifier: Any = noted("the end user's id for safety reports")
    prompt_cache_key: Any = noted("the caller's cache key (prefix caching is automatic)")
    length_penalty: Any = refused("beam search is not supported", 1, 1.0)
    store: Any = refused("responses are not stored", False)
    service_tier: Any = refused("there is one service tier", "auto", "default")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: Any = refused("beam search is not supported", False)
    logits_processors: Any = refused("custom logits processors are not supported")
    allowed_token_ids: Any = refused("allowed_token_ids is not supported")
    bad_words: Any = refused("bad_words is not supported")
    truncate_prompt_tokens: Any = refused("prompts are never truncated")
    skip_special_tokens: Any = refused("special tokens are always skipped", True)
    spaces_between_special_tokens: Any = refused("special tokens are always skipped", True)
    return_tokens_as_token_ids: Any = refused("tokens are returned as text", False)
    return_token_ids: Any = refused("token ids are not returned; use /tokenize", False)
    mm_processor_kwargs: Any = refused("this model takes text only", {})
    kv_transfer_params: Any = refused("KV transfer between servers is not supported")
    vllm_xargs: Any = refused("custom extension arguments are not supported", {})


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``.

    Attributes:
        prompt: one text, a list of texts, one list of token ids or a list of them; a list
            yields one choice per prompt, indexed in order.
        max_tokens: most tokens generated per prompt (default: the model's, else 16, as
            OpenAI's).
        logprobs: also return the log-probabilities of this many most likely tokens per
            position (``0`` for the chosen token's only).
        echo: the prompt's text comes first in each choice's text (and, with ``logprobs``, its
            tokens first in the log-probabilities, the first one without a value).
    """

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: Any = refused("suffixes (insertion) are not supported", "")


class TextPart(_Request):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


#: Content part types of OpenAI's and vLLM's multimodal messages: refused, the model takes text
#: only (SRV-118).
MEDIA_PART_TYPES = (
    "image_url",
    "image",
    "image_embeds",
    "input_image",
    "input_audio",
    "audio_url",
    "video_url",
    "file",
)


class MediaPart(_Request):
    """An image, audio, video or file part: declared so that it is refused with a clear
    message (this model takes text only) rather than a schema error."""

    type: Literal[
        "image_url",
        "image",
        "image_embeds",
        "input_image",
        "input_audio",
        "audio_url",
        "video_url",
        "file",
    ]


class FunctionCall(_Request):
    """A called function: its name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(_Request):
    """One tool call of an assistant message (given back in a conversation, or replied)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One message of a conversation; content given as parts is joined into one text.

    Attributes:
        tool_calls: an assistant message's calls, fed back through the chat template.
        tool_call_id: a ``tool`` message's answer to that call.
    """

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart | MediaPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def media_part(self) -> int | None:
        """The index of the first non-text part, ``None`` when all are text."""
        if self.content is None or isinstance(self.content, str):
            return None
        return next((i for i, p in enumerate(self.content) if isinstance(p, MediaPart)), None)

    @property
    def text(self) -> str:
        """The content as one text (a ``null`` content, as of an assistant's tool calls, is
        empty).

        Raises:
            InvalidRequest: a part is not text (this model takes text only).
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if self.media_part() is not None:
            raise InvalidRequest(
                "this model takes text only: image, audio and file parts are refused"
            )
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Request):
    """A tool's function: its name, description and JSON-schema parameters."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    """One of chat's ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """``tool_choice`` naming the one function the reply calls."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``.

    Attributes:
        messages: the conversation, rendered through the model's chat template.
        max_tokens, max_completion_tokens: most tokens generated; when both are absent, up to
            the rest of the model's context.
        logprobs: return the chosen tokens' log-probabilities.
        top_logprobs: with ``logprobs``, also this many most likely tokens per position
            (without ``logprobs`` it is refused, as vLLM does).
        chat_template_kwargs: further variables of the chat template, e.g.
            ``{"enable_thinking": false}`` for Qwen3; a key the template does not read is
            refused with 400.
        add_generation_prompt: open the assistant's turn after the messages (vLLM's).
        continue_final_message: leave the last (assistant) message open, to be continued;
            it takes ``add_generation_prompt: false`` (both true is a 400), as vLLM's.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = refused("function calling is not supported", [])
    function_call: Any = refused("function calling is not supported", "none")
    echo: Any = refused("echoing the last message is not supported", False)
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    chat_template: Any = refused("only the model's own chat template is used")
    documents: Any = refused("documents are not supported")
    audio: Any = refused("audio output is not supported")
    modalities: Any = refused("only text output is supported", ["text"])
    prediction: Any = refused("predicted outputs are not supported")
    reasoning_effort: Any = refused(
        'Qwen3 thinks or not: use chat_template_kwargs {"enable_thinking": false}'
    )
    verbosity: Any = refused("verbosity is not supported")
    web_search_options: Any = refused("web search is not supported")
    moderation: Any = refused("moderation is not supported")
    prompt_cache_options: Any = refused("prefix caching is automatic and not configurable")
    prompt_cache_retention: Any = refused("prefix caching is automatic and not configurable")


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
    """Legacy completions logprobs: parallel lists, one entry per token (with ``echo``, the
    prompt's tokens first; the very first has no log-probability)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's prompt log-probability entry: one token's log-probability, its rank in the
    distribution (1 for the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


#: Per prompt position: ``None`` for the first, else the prompt token's entry and the most
#: likely alternatives', by token id (a string key, as in JSON).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


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
    when it did not think) and ``content`` is ``None`` when nothing followed the thinking.
    The calls it makes are in ``tool_calls`` (empty for none, as vLLM)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(BaseModel):
    """A streamed piece of a call: the name once, the arguments in fragments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """OpenAI's incremental ``delta.tool_calls`` entry; ``index`` says which call."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


class TokenizeCompletionRequest(_Request):
    """``POST /tokenize`` of a text, as the completions endpoint tokenizes a prompt.

    Attributes:
        return_token_strs: also return each token's text.
    """

    model: str | None = None
    prompt: str
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """``POST /tokenize`` of a conversation, as the chat endpoint renders it (the assistant's
    turn opened)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    """The token ids of a prompt, their count and the model's context length."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """``POST /detokenize``: the text of token ids (special tokens skipped)."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


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
