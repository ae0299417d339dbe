"""Tool calls of chat replies (SRV-132..SRV-134): how a request's ``tools`` and
``tool_choice`` shape the reply, and how the reply is read back into OpenAI ``tool_calls``.

- ``auto`` (needs ``--enable-auto-tool-choice --tool-call-parser hermes``): the model decides;
  each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` it writes (Qwen3's, the
  Hermes format) becomes a call, the text before the first one stays ``content``.
- ``required``: the reply is constrained by a JSON schema to a list of calls of the given
  tools, ``[{"name": ..., "parameters": {...}}, ...]`` (vLLM's form), one or more (exactly one
  with ``parallel_tool_calls: false``).
- a named function: the reply is constrained to that function's parameters, and is its
  arguments.
- ``none``: the tools are rendered, nothing is read back.

Tool-call grammars write compact JSON (no free whitespace): the arguments go back to the
client as a string anyway, and a small model given free whitespace can spend its whole budget
on it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from pagedkv.entrypoints.server.structured import Constraint
from pagedkv.errors import InvalidRequest

#: The tool-call parsers ``--tool-call-parser`` takes.
TOOL_CALL_PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

Kind = Literal["none", "auto", "required", "named"]


def check_tool_parser(name: str | None, auto_tool_choice: bool) -> None:
    """Refuse a parser this server does not have, or auto tool choice without one (SRV-136).

    Raises:
        InvalidRequest: naming the parser and those there are.
    """
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise InvalidRequest(
            f"tool call parser {name!r} is not supported; available: {', '.join(TOOL_CALL_PARSERS)}"
        )
    if auto_tool_choice and name is None:
        raise InvalidRequest("--enable-auto-tool-choice needs --tool-call-parser (hermes)")


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=text))


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a chat request's reply is read for tool calls.

    Attributes:
        kind: ``auto``, ``required``, a ``named`` function, or ``none``.
        parallel: several calls may be returned.
        name: the named function.
    """

    kind: Kind
    parallel: bool = True
    name: str | None = None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole reply; a reply that does not parse is content."""
        if self.kind == "none":
            return text, []
        if self.kind == "named":
            assert self.name is not None
            try:
                return None, [_call(self.name, json.loads(text))]
            except ValueError:
                return text, []
        if self.kind == "required":
            try:
                items = json.loads(text)
                calls = [_call(str(i["name"]), i.get("parameters", {})) for i in items]
            except (ValueError, TypeError, KeyError):
                return text, []
            return None, calls if self.parallel else calls[:1]
        return self._hermes(text)

    def _hermes(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(OPEN)
        if start < 0:
            return text, []
        calls = []
        for body in _CALL.findall(text):
            call = _hermes_call(body)
            if call is not None:
                calls.append(call)
        tail = text[text.rfind(CLOSE) + len(CLOSE) :] if CLOSE in text else text[start:]
        if tail.lstrip().startswith(OPEN):  # a last call the budget cut: parse what came
            call = _hermes_call(tail.lstrip()[len(OPEN) :])
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = text[:start]
        return (content if content.strip() else None), calls if self.parallel else calls[:1]

    def streamer(self) -> ToolCallStream:
        return ToolCallStream(self)


def _hermes_call(body: str) -> ToolCall | None:
    """The call of one ``<tool_call>`` body, ``None`` if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return _call(value["name"], value.get("arguments", {}))


@dataclass(slots=True)
class ToolCallStream:
    """Streamed tool calls of one completion (SRV-133): content text passes through until a
    call opens (text that may begin ``<tool_call>`` is held back), each call goes out as one
    ``delta.tool_calls`` entry (index, id, type, name, arguments) once it is whole, and text
    after the first call is dropped, as the whole reply's content is the text before it."""

    mode: ToolMode
    pending: str = ""
    inside: bool = False
    sent: int = 0
    closed: bool = False
    buffer: list[str] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return self.sent > 0

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and the call deltas ``text`` releases (everything when ``final``)."""
        if self.mode.kind == "none":
            return text, []
        if self.mode.kind in ("required", "named"):
            self.buffer.append(text)
            if not final:
                return "", []
            content, calls = self.mode.parse("".join(self.buffer))
            return content or "", self._deltas(calls)
        return self._feed_hermes(text, final)

    def _deltas(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        out = []
        for call in calls:
            if not self.mode.parallel and self.sent:
                break
            out.append(
                DeltaToolCall(
                    index=self.sent,
                    id=call.id,
                    type="function",
                    function=DeltaFunctionCall(
                        name=call.function.name, arguments=call.function.arguments
                    ),
                )
            )
            self.sent += 1
        return out

    def _feed_hermes(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.pending += text
        content: list[str] = []
        deltas: list[DeltaToolCall] = []
        while True:
            if not self.inside:
                at = self.pending.find(OPEN)
                if at >= 0:
                    if not self.called:
                        content.append(self.pending[:at])
                    self.pending, self.inside = self.pending[at + len(OPEN) :], True
                    continue
                keep = 0 if final else _held(self.pending)
                released = self.pending[: len(self.pending) - keep]
                if not self.called:
                    content.append(released)
                self.pending = self.pending[len(self.pending) - keep :]
                break
            end = self.pending.find(CLOSE)
            if end < 0:
                if final:
                    call = _hermes_call(self.pending)
                    if call is not None:
                        deltas.extend(self._deltas([call]))
                    elif not self.called:
                        content.append(OPEN + self.pending)
                    self.pending = ""
                break
            call = _hermes_call(self.pending[:end])
            if call is not None:
                deltas.extend(self._deltas([call]))
            self.pending, self.inside = self.pending[end + len(CLOSE) :], False
        return "".join(content), deltas


def _held(text: str) -> int:
    """Characters at the end of ``text`` that may begin ``<tool_call>``."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def _tool_schema(body: ChatCompletionRequest, parallel: bool) -> dict[str, Any]:
    """vLLM's schema of a ``required`` reply: a list of calls of the given tools."""
    assert body.tools is not None
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in body.tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_mode(
    body: ChatCompletionRequest, auto_tool_choice: bool
) -> tuple[ToolMode | None, Constraint | None]:
    """How the request's reply is read, and the constraint ``required`` or a named function
    puts on it.

    Raises:
        APIError: ``tool_choice`` without ``tools``, a named function not among them, or
            ``auto`` on a server started without ``--enable-auto-tool-choice``.
    """
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, None
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolMode("none"), None
    if choice == "auto":
        if not auto_tool_choice:
            raise APIError(
                400,
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                "--tool-call-parser hermes",
                param="tool_choice",
            )
        return ToolMode("auto", parallel), None
    if choice == "required":
        params = StructuredOutputsParams(
            json=_tool_schema(body, parallel), disable_any_whitespace=True
        )
        return ToolMode("required", parallel), Constraint(params, "tool_choice")
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    tool = next((t for t in body.tools if t.function.name == name), None)
    if tool is None:
        raise APIError(
            400, f"tool_choice names {name!r}, which is not among tools", param="tool_choice"
        )
    params = StructuredOutputsParams(
        json=tool.function.parameters or {"type": "object"}, disable_any_whitespace=True
    )
    return ToolMode("named", False, name), Constraint(params, "tool_choice")
