"""Structured outputs and tool calls through the real ``openai`` client against the server
(specs/serving.md SRV-130..SRV-136), on a tiny seeded Qwen3 checkpoint with Qwen3's own chat
template. The tiny model writes noise and never calls a tool by itself: what parses, matches
or calls is the grammar's doing (and a ``<tool_call>`` it writes under ``tool_choice: auto``
is steered there by a regex constraint)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from server_harness import error_of, post_json, running
from serving_models import tool_chat_model

from pagedkv.backend import load_engine
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.server.app import ServerConfig, create_app
from pagedkv.entrypoints.server.tool_calls import ToolMode
from pagedkv.errors import InvalidRequest
from pagedkv.testing.tiny_qwen3 import model_device

MODEL = "tiny-tools"
CONFIG = EngineConfig(page_size=8, num_pages=1024, max_num_batched_tokens=1024, max_model_len=2048)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tool_chat_model(tmp_path_factory.mktemp("tools-model"))


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    engine = load_engine(model_dir, CONFIG, device=model_device())
    with running(create_app(engine, MODEL, config=config)) as server:
        yield server.url


@pytest.fixture(scope="module")
def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def whitespace_bias(model_dir: Path) -> dict[str, int]:
    """-100 on every whitespace-only token: a random model given JSON's free whitespace
    spends its budget on it; the bias steers it off without touching what the grammar
    allows."""
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    spaces = "ĠĊĉč"  # byte-level spellings of space, newline, tab, carriage return
    return {str(i): -100 for t, i in vocab.items() if t and all(c in spaces for c in t)}


def post(url: str, endpoint: str, **body: Any) -> httpx.Response:
    body.setdefault("model", MODEL)
    if endpoint == "completions":
        body.setdefault("prompt", "Give me JSON:")
    else:
        body.setdefault("messages", [{"role": "user", "content": "Give me JSON"}])
    path = "completions" if endpoint == "completions" else "chat/completions"
    return post_json(f"{url}/v1/{path}", body)


def texts(result: dict[str, Any]) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in result["choices"]]


# -- structured outputs --------------------------------------------------------------------


@pytest.mark.spec("SRV-130")
def test_json_schema_holds_in_100_of_100_samples(
    client: OpenAI, whitespace_bias: dict[str, int]
) -> None:
    """``response_format: json_schema`` (strict) at temperature 1.0: 100 samples (4 requests
    of n=25) all parse and validate. Catches: the field dropped (noise never parses), the
    constraint lost for some of n, or a sample cut before its document closes."""
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    valid = 0
    for seed in range(4):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format=response_format,
            temperature=1.0,
            n=25,
            seed=seed,
            max_tokens=120,
            logit_bias=whitespace_bias,
        )
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
            valid += 1
    assert valid == 100


@pytest.mark.spec("SRV-130")
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        ({"structured_outputs": {"regex": "[a-f]{4}"}}, lambda t: re.fullmatch("[a-f]{4}", t)),
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        (
            {"structured_outputs": {"grammar": 'start: "x" DIGIT\nDIGIT: /[0-9]/'}},
            lambda t: re.fullmatch("x[0-9]", t),
        ),
        ({"guided_json": {"enum": ["on", "off"]}}, lambda t: json.loads(t) in ("on", "off")),
        ({"guided_regex": "[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{2}", t)),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_grammar": 'start: "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
    ],
    ids=[
        "json_object",
        "so-json",
        "so-regex",
        "so-choice",
        "so-grammar",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ],
)
def test_every_constraint_field_holds(
    url: str, whitespace_bias: dict[str, int], endpoint: str, fields: dict[str, Any], check: Any
) -> None:
    """Each field that carries a constraint, on both endpoints, n=4 at temperature 1.0.
    Catches: a field accepted and dropped, or read into the wrong kind."""
    response = post(
        url,
        endpoint,
        n=4,
        temperature=1.0,
        seed=1,
        max_tokens=150,
        logit_bias=whitespace_bias,
        **fields,
    )
    assert response.status_code == 200, response.text
    for choice, text in zip(response.json()["choices"], texts(response.json()), strict=True):
        assert choice["finish_reason"] == "stop", text
        assert check(text), text


@pytest.mark.spec("SRV-130")
def test_text_format_is_no_constraint_and_two_constraints_are_refused(url: str) -> None:
    """``{"type": "text"}`` changes nothing; a second constraint is a 400 naming it.
    Catches: one of two constraints silently dropped."""
    plain = post(url, "completions", temperature=0, max_tokens=8).json()
    same = post(
        url, "completions", temperature=0, max_tokens=8, response_format={"type": "text"}
    ).json()
    assert texts(same) == texts(plain)
    error = error_of(post(url, "completions", guided_regex="a", guided_choice=["b"]), 400)
    assert error["param"] == "guided_choice"
    assert error["code"] == "invalid_structured_outputs"


@pytest.mark.spec("SRV-131")
@pytest.mark.parametrize(
    ("fields", "param", "problem"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"properties": {"a": {"$ref": "#/nowhere"}}},
                    },
                }
            },
            "response_format",
            "nowhere",
        ),
        ({"guided_regex": "a(b"}, "guided_regex", "regex"),
        (
            {"structured_outputs": {"grammar": "start: missing_rule"}},
            "structured_outputs",
            "missing_rule",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        (
            {"structured_outputs": {"structural_tag": "x"}},
            "structured_outputs.structural_tag",
            "not supported",
        ),
    ],
    ids=["dangling-ref", "bad-regex", "bad-grammar", "bad-json", "structural-tag"],
)
def test_a_constraint_that_cannot_compile_is_a_400(
    url: str, fields: dict[str, Any], param: str, problem: str
) -> None:
    """Never 500, never a failed stream: 400 naming the field and the problem."""
    error = error_of(post(url, "chat", **fields), 400)
    assert error["param"] == param
    assert problem in error["message"]


# -- tool calls ----------------------------------------------------------------------------


def test_hermes_parser_reads_calls_and_content() -> None:
    """Unit: content before the first call, every call with a ``call_`` id and JSON-string
    arguments, the first only without parallel calls, unparseable text left as content.
    Catches: markup leaking into content, arguments as objects, calls lost or invented."""
    text = (
        "Let me check.\n" + HERMES_CALL + '\n<tool_call>\n{"name": "get_time", '
        '"arguments": {"zone": "UTC"}}\n</tool_call>'
    )
    content, calls = ToolMode("auto").parse(text)
    assert content == "Let me check.\n"
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    assert all(c.id.startswith("call_") for c in calls)
    assert len(ToolMode("auto", parallel=False).parse(text)[1]) == 1
    assert ToolMode("auto").parse("no calls") == ("no calls", [])
    assert ToolMode("auto").parse("<tool_call>{broken</tool_call>")[1] == []


@pytest.mark.spec("SRV-133")
@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_streamed_calls_add_up_to_the_whole_reply(size: int) -> None:
    """Unit: fed in pieces of every size, the stream's content and calls equal the whole
    parse, and no piece of markup reaches the content. Catches: a ``<tool_call>`` split
    over two deltas leaking its first half as content."""
    text = "Sure " + HERMES_CALL + "\n" + HERMES_CALL.replace("Oslo", "Paris")
    stream = ToolMode("auto").streamer()
    content, deltas = "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        out, calls = stream.feed(piece, i == len(pieces) - 1)
        content += out
        deltas.extend(calls)
    whole_content, whole_calls = ToolMode("auto").parse(text)
    assert content == whole_content
    assert [d.index for d in deltas] == [0, 1]
    assert [d.function.name for d in deltas] == [c.function.name for c in whole_calls]
    assert [d.function.arguments for d in deltas] == [c.function.arguments for c in whole_calls]
    assert all(d.id and d.type == "function" for d in deltas)


@pytest.mark.spec("SRV-132")
@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hermes_calls_out_of_the_reply(client: OpenAI, stream: bool) -> None:
    """Under ``tool_choice: auto`` a reply writing ``<tool_call>`` (steered there by a regex)
    comes back as ``tool_calls`` with ``finish_reason: tool_calls``, streamed or not.
    Catches: the call left in content, or its arguments not a JSON string."""
    steer: Any = {"structured_outputs": {"regex": re.escape(HERMES_CALL)}}
    calls: list[tuple[str, str]] = []
    if not stream:
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, extra_body=steer
        )
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    else:
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            max_tokens=200,
            extra_body=steer,
            stream=True,
        )
        pieces: dict[int, list[str]] = {}
        names: dict[int, str] = {}
        finish = None
        for chunk in chunks:
            for c in chunk.choices:
                assert not (c.delta.content or "").strip(), c.delta.content
                for call in c.delta.tool_calls or []:
                    if call.function and call.function.name:
                        names[call.index] = call.function.name
                    pieces.setdefault(call.index, []).append(
                        (call.function.arguments or "") if call.function else ""
                    )
                finish = c.finish_reason or finish
        assert finish == "tool_calls"
        calls = [(names[i], "".join(pieces[i])) for i in sorted(pieces)]
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.spec("SRV-134")
def test_none_renders_tools_and_reads_nothing(client: OpenAI) -> None:
    """``tool_choice: none``: the same steered call text stays content. Catches: parsing
    applied when the client asked for none."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=200,
        extra_body={"structured_outputs": {"regex": re.escape(HERMES_CALL)}},
    )
    (choice,) = reply.choices
    assert choice.message.content == HERMES_CALL
    assert not choice.message.tool_calls
    assert choice.finish_reason == "stop"


@pytest.mark.spec("SRV-134")
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_given_tools(client: OpenAI, parallel: bool) -> None:
    """``required`` at temperature 1.0: every reply is one or more calls of the given tools
    with arguments matching their parameters (exactly one without parallel calls).
    Catches: the grammar not applied (noise), or parallel_tool_calls ignored."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        n=6,
        temperature=1.0,
        seed=4,
        max_tokens=150,
        parallel_tool_calls=parallel,
    )
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        calls = choice.message.tool_calls or []
        assert calls
        if not parallel:
            assert len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.spec("SRV-134")
def test_named_function_and_refusals(client: OpenAI, url: str) -> None:
    """A named function gets a call of it with valid arguments; a name not among tools,
    tool_choice without tools, are 400s naming tool_choice. Catches: the name ignored."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        temperature=1.0,
        seed=9,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
    )
    (choice,) = reply.choices
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    named = {"type": "function", "function": {"name": "nope"}}
    error = error_of(post(url, "chat", tools=[WEATHER], tool_choice=named), 400)
    assert error["param"] == "tool_choice"
    error = error_of(post(url, "chat", tool_choice="required"), 400)
    assert error["param"] == "tool_choice"


@pytest.mark.spec("SRV-135", "SRV-133")
@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_call_tool_result_answer(client: OpenAI, url: str, stream: bool) -> None:
    """Call (required) -> the tool's result as a ``tool`` message after the assistant's
    ``tool_calls`` -> an answer; the rendered conversation carries the call and the result.
    Catches: tool messages or assistant tool_calls refused or dropped from the prompt."""
    if stream:
        tool_calls: list[dict[str, Any]] = []
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            stream=True,
            seed=2,
            temperature=1.0,
        ):
            for c in chunk.choices:
                for call in c.delta.tool_calls or []:
                    assert call.function is not None
                    tool_calls.append(
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {
                                "name": call.function.name,
                                "arguments": call.function.arguments,
                            },
                        }
                    )
    else:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            seed=2,
            temperature=1.0,
        )
        tool_calls = [c.model_dump() for c in reply.choices[0].message.tool_calls or []]
    assert tool_calls
    conversation: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": "sunny, 21C"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(
        f"{url}/tokenize", json={"messages": conversation, "return_token_strs": True}, timeout=30
    )
    assert rendered.status_code == 200, rendered.text
    text = httpx.post(
        f"{url}/detokenize", json={"tokens": rendered.json()["tokens"]}, timeout=30
    ).json()["prompt"]
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' in text


@pytest.mark.spec("SRV-134", "SRV-136")
def test_auto_needs_the_servers_flags(model_dir: Path) -> None:
    """A server started without --enable-auto-tool-choice refuses ``auto`` (the default with
    tools) naming the flag; a parser other than hermes is refused when the server is
    configured. Catches: tools silently rendered with replies never read."""
    with pytest.raises(InvalidRequest, match=r"'mistral'.*hermes"):
        ServerConfig(tool_call_parser="mistral")
    with pytest.raises(InvalidRequest, match="needs --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    engine = load_engine(model_dir, CONFIG, device=model_device())
    with running(create_app(engine, MODEL)) as server:
        error = error_of(post(server.url, "chat", tools=[WEATHER]), 400)
        assert "--enable-auto-tool-choice" in error["message"]
        assert (
            post(server.url, "chat", tools=[WEATHER], tool_choice="none", max_tokens=2).status_code
            == 200
        )


@pytest.mark.spec("SRV-136")
def test_serve_refuses_an_unknown_tool_call_parser() -> None:
    """``pagedkv serve --tool-call-parser mistral`` exits 1 before loading a model, naming
    the parser and the ones there are; the hermes flags parse. Catches: vLLM's flags
    unrecognised (status 2), or an unknown parser accepted."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "serve",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "mistral",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "'mistral'" in result.stderr
    assert "hermes" in result.stderr
