"""Every request field of both endpoints honored or refused (specs/serving.md SRV-100..103),
and parallel sampling over HTTP (SRV-006).

:data:`HONORED` holds, for every honored field of both request models, a check that the field
changes the response as its definition says; refused fields are found from the models (declared
with ``refused``) and checked to be answered 400 naming them, their neutral values accepted. The
coverage test fails when a request model gains a field that is in neither.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import error_of, metric, post_json, running, sse_payloads, wait_idle
from serving_models import serving_model_dir, tiny_chat_model

from pagedkv.assets import has_default_model
from pagedkv.backend import load_engine
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.entrypoints.server.app import create_app
from pagedkv.entrypoints.server.async_engine import AsyncEngine
from pagedkv.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.entrypoints.server.request_checks import noted_fields, refused_fields
from pagedkv.interfaces import Engine
from pagedkv.testing.tiny_qwen3 import model_device

MODEL = "fields-model"
CONFIG = EngineConfig(page_size=8, num_pages=128, max_num_batched_tokens=256, max_model_len=512)
PROMPT = "def parse(text):\n"
LONG_PROMPT = "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n" * 3
ENDPOINTS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}


@dataclass(frozen=True)
class Served:
    url: str
    bridge: AsyncEngine
    reference: Engine

    def ask(self, endpoint: str, expect: int = 200, **fields: Any) -> dict[str, Any]:
        """POST a request with ``fields`` over a default body; its JSON (``expect``ed status)."""
        body: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
        if endpoint == "completions":
            body["prompt"] = PROMPT
        else:
            body["messages"] = [{"role": "user", "content": PROMPT}]
        body.update(fields)
        path = "completions" if endpoint == "completions" else "chat/completions"
        response = post_json(f"{self.url}/v1/{path}", body)
        assert response.status_code == expect, response.text
        result: dict[str, Any] = response.json()
        return result

    def prompt_ids(self, endpoint: str) -> list[int]:
        tokenizer = self.reference.tokenizer
        assert tokenizer is not None
        if endpoint == "completions":
            return tokenizer.encode(PROMPT)
        return tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])


def texts(result: dict[str, Any]) -> list[str]:
    """The text of each choice, in index order."""
    choices = sorted(result["choices"], key=lambda c: c["index"])
    return [c["text"] if "text" in c else c["message"]["content"] for c in choices]


def token_count(result: dict[str, Any]) -> int:
    return int(result["usage"]["completion_tokens"])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = serving_model_dir(tmp_path_factory)
    app = create_app(load_engine(model_dir, CONFIG, device=model_device()), MODEL, 1 << 20)
    reference = load_engine(model_dir, CONFIG, device=model_device())
    with running(app) as server:
        yield Served(server.url, server.bridge, reference)


@pytest.fixture
def server(served: Served) -> Iterator[Served]:
    yield served
    wait_idle(served.bridge)


def offline(served: Served, endpoint: str, **params: Any) -> list[int]:
    """The first completion's tokens the Python API gives the default body's prompt."""
    base: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    (out,) = run_to_completion(
        served.reference, [served.prompt_ids(endpoint)], SamplingParams(**{**base, **params})
    )
    return list(out.token_ids)


def first_tokens(served: Served, endpoint: str, result: dict[str, Any]) -> list[int]:
    """Token ids of the first choice, by tokenizing nothing: the logprobs entries name them."""
    tokenizer = served.reference.tokenizer
    assert tokenizer is not None
    return tokenizer.encode(texts(result)[0])


# -- the checks of honored fields --------------------------------------------------------------


def check_model(s: Served, e: str) -> None:
    s.ask(e, model=MODEL)
    assert error_of(post_json_with(s, e, model="other"), 404)["param"] == "model"


def post_json_with(s: Served, e: str, **fields: Any) -> httpx.Response:
    body: dict[str, Any] = {"max_tokens": 2}
    body.update(
        {"prompt": PROMPT}
        if e == "completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    body.update(fields)
    path = "completions" if e == "completions" else "chat/completions"
    return post_json(f"{s.url}/v1/{path}", body)


def check_prompt(s: Served, e: str) -> None:
    ids = s.prompt_ids(e)
    assert texts(s.ask(e, prompt=ids)) == texts(s.ask(e, prompt=PROMPT))
    assert s.ask(e, prompt=ids)["usage"]["prompt_tokens"] == len(ids)


def check_messages(s: Served, e: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x = 1"}]
    tokenizer = s.reference.tokenizer
    assert tokenizer is not None
    ids = tokenizer.apply_chat_template(messages)
    result = s.ask(e, messages=messages)
    assert result["usage"]["prompt_tokens"] == len(ids)
    (out,) = run_to_completion(
        s.reference, [ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    assert texts(result) == [out.text]


def check_max_tokens(s: Served, e: str) -> None:
    assert token_count(s.ask(e, max_tokens=3)) == 3


def check_max_completion_tokens(s: Served, e: str) -> None:
    assert token_count(s.ask(e, max_tokens=6, max_completion_tokens=2)) == 2


def check_temperature(s: Served, e: str) -> None:
    greedy = texts(s.ask(e, temperature=0))
    hot = [texts(s.ask(e, temperature=3.0, seed=i))[0] for i in range(3)]
    assert any(t != greedy[0] for t in hot)


def _greedy_when(s: Served, e: str, **fields: Any) -> None:
    """A filter keeping only the argmax makes a hot sample greedy."""
    greedy = texts(s.ask(e, temperature=0))
    for seed in range(3):
        assert texts(s.ask(e, temperature=3.0, seed=seed, **fields)) == greedy


def check_top_p(s: Served, e: str) -> None:
    _greedy_when(s, e, top_p=1e-9)


def check_top_k(s: Served, e: str) -> None:
    _greedy_when(s, e, top_k=1)


def check_min_p(s: Served, e: str) -> None:
    _greedy_when(s, e, min_p=1.0)


def check_seed(s: Served, e: str) -> None:
    first, again = (texts(s.ask(e, temperature=1.5, seed=11)) for _ in range(2))
    assert first == again
    others = [texts(s.ask(e, temperature=1.5, seed=12 + i)) for i in range(3)]
    assert any(o != first for o in others)


def check_stop(s: Served, e: str) -> None:
    whole = texts(s.ask(e, max_tokens=12))[0]
    stop = whole[3:6]
    result = s.ask(e, max_tokens=12, stop=[stop])
    assert texts(result)[0] == whole[: whole.index(stop)]
    assert result["choices"][0]["stop_reason"] == stop


def check_include_stop_str_in_output(s: Served, e: str) -> None:
    whole = texts(s.ask(e, max_tokens=12))[0]
    stop = whole[3:6]
    kept = texts(s.ask(e, max_tokens=12, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept == whole[: whole.index(stop) + len(stop)]


def generated(s: Served) -> float:
    text = httpx.get(f"{s.url}/metrics").text
    return metric(text, "vllm:generation_tokens_total", model_name=MODEL)


def check_n(s: Served, e: str) -> None:
    before = generated(s)
    result = s.ask(e, n=3, temperature=1.5, seed=5)
    assert generated(s) - before == token_count(result) == 3 * 6  # every completion counts
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    assert texts(result)[0] == texts(s.ask(e, temperature=1.5, seed=5))[0]
    assert texts(result)[1] == texts(s.ask(e, temperature=1.5, seed=6))[0]


def _sum_logprobs(choice: dict[str, Any]) -> float:
    logprobs = choice["logprobs"]
    if "token_logprobs" in logprobs:
        return float(sum(logprobs["token_logprobs"]))
    return float(sum(entry["logprob"] for entry in logprobs["content"]))


def check_best_of(s: Served, e: str) -> None:
    logprobs: dict[str, Any] = {"logprobs": 0} if e == "completions" else {"logprobs": True}
    (best,) = s.ask(e, best_of=3, temperature=1.5, seed=20, **logprobs)["choices"]
    runs = [s.ask(e, temperature=1.5, seed=20 + i, **logprobs)["choices"][0] for i in range(3)]
    top = max(runs, key=_sum_logprobs)
    assert _sum_logprobs(best) == pytest.approx(_sum_logprobs(top), abs=1e-4)


def check_stream(s: Served, e: str) -> None:
    path = "completions" if e == "completions" else "chat/completions"
    body = (
        {"prompt": PROMPT}
        if e == "completions"
        else {"messages": [{"role": "user", "content": PROMPT}]}
    )
    response = httpx.post(
        f"{s.url}/v1/{path}", json={**body, "max_tokens": 3, "stream": True}, timeout=60
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    assert sse_payloads(response.content)[-1] == "[DONE]"


def check_stream_options(s: Served, e: str) -> None:
    path = "completions" if e == "completions" else "chat/completions"
    body = (
        {"prompt": PROMPT}
        if e == "completions"
        else {"messages": [{"role": "user", "content": PROMPT}]}
    )
    body.update(max_tokens=3, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    payloads = sse_payloads(httpx.post(f"{s.url}/v1/{path}", json=body, timeout=60).content)
    assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 3
    # without stream it would be dropped: refused, as vLLM does (SRV-118)
    error = error_of(post_json_with(s, e, stream_options={"include_usage": True}), 400)
    assert error["param"] == "stream_options"


def check_priority(s: Served, e: str) -> None:
    """This server schedules fcfs: priority 0 is served, another refused naming the field
    (that the priority policy takes it is tests/test_server_vllm_fields.py's, SRV-118)."""
    assert texts(s.ask(e, priority=0)) == texts(s.ask(e))
    error = error_of(post_json_with(s, e, priority=3), 400)
    assert error["param"] == "priority"
    assert "priority=3" in error["message"]


def check_request_id(s: Served, e: str) -> None:
    """The response's id is the endpoint's prefix then the request_id, as vLLM's."""
    prefix = "cmpl" if e == "completions" else "chatcmpl"
    assert s.ask(e, request_id=f"mine-{e}")["id"] == f"{prefix}-mine-{e}"
    assert s.ask(e)["id"] != s.ask(e)["id"]


def check_add_special_tokens(s: Served, e: str) -> None:
    """With a tokenizer that adds a BOS (the served one's post-processor given one for the
    check), ``add_special_tokens: true`` adds it to the prompt; false, the default, does not."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = s.bridge._engine_loop.engine.tokenizer
    assert tokenizer is not None
    backend = tokenizer.hf.backend_tokenizer
    saved = backend.post_processor
    bos = "<|endoftext|>"
    backend.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.hf.convert_tokens_to_ids(bos))]
    )
    try:
        plain = s.ask(e, max_tokens=1)["usage"]["prompt_tokens"]
        added = s.ask(e, max_tokens=1, add_special_tokens=True)["usage"]["prompt_tokens"]
    finally:
        backend.post_processor = saved
    assert added == plain + 1


def check_add_generation_prompt(s: Served, e: str) -> None:
    """false renders the conversation without the assistant's turn opened: fewer tokens."""
    opened = s.ask(e, max_tokens=1)["usage"]["prompt_tokens"]
    closed = s.ask(e, max_tokens=1, add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert closed < opened


def check_continue_final_message(s: Served, e: str) -> None:
    """The last assistant message is continued: its prompt ends with that message's text,
    no end-of-turn after it; with add_generation_prompt also true it is a 400."""
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "x = 1"}]
    tokenizer = s.reference.tokenizer
    assert tokenizer is not None
    fields: dict[str, Any] = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
    continued = s.ask(e, add_generation_prompt=False, continue_final_message=True, **fields)
    ids = [int(next(iter(p))) for p in continued["prompt_logprobs"][1:]]
    assert tokenizer.decode(ids).endswith("x = 1")
    closed = s.ask(e, add_generation_prompt=False, **fields)
    closed_ids = [int(next(iter(p))) for p in closed["prompt_logprobs"][1:]]
    assert closed_ids[: len(ids)] == ids  # the closed turn goes on: its end-of-turn tokens
    assert len(closed_ids) > len(ids)
    error_of(post_json_with(s, e, continue_final_message=True), 400)


def _eos(s: Served) -> str:
    tokenizer = s.reference.tokenizer
    assert tokenizer is not None
    assert tokenizer.eos_token_id is not None
    return str(tokenizer.eos_token_id)


def check_ignore_eos(s: Served, e: str) -> None:
    forced = {_eos(s): 100.0}
    assert token_count(s.ask(e, ignore_eos=False, logit_bias=forced)) == 1
    assert token_count(s.ask(e, ignore_eos=True, logit_bias=forced)) == 6


def check_logit_bias(s: Served, e: str) -> None:
    greedy = offline(s, e)
    moved = s.ask(e, logit_bias={str(greedy[0]): -100})
    assert first_tokens(s, e, moved)[:1] != greedy[:1]


def check_min_tokens(s: Served, e: str) -> None:
    result = s.ask(e, ignore_eos=False, logit_bias={_eos(s): 100.0}, min_tokens=3)
    assert token_count(result) == 4
    assert result["choices"][0]["finish_reason"] == "stop"


def check_stop_token_ids(s: Served, e: str) -> None:
    greedy = offline(s, e)
    result = s.ask(e, stop_token_ids=[greedy[2]])
    assert token_count(result) == greedy.index(greedy[2]) + 1
    assert result["choices"][0]["stop_reason"] == greedy[2]


def _penalised(field: str, value: float) -> Callable[[Served, str], None]:
    def check(s: Served, e: str) -> None:
        want = offline(s, e, max_tokens=24, **{field: value})
        result = s.ask(e, max_tokens=24, **{field: value})
        tokenizer = s.reference.tokenizer
        assert tokenizer is not None
        assert texts(result)[0] == tokenizer.decode(want)
        assert want != offline(s, e, max_tokens=24)

    return check


def check_logprobs(s: Served, e: str) -> None:
    if e == "completions":
        logprobs = s.ask(e, logprobs=2)["choices"][0]["logprobs"]
        assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    else:
        content = s.ask(e, logprobs=True)["choices"][0]["logprobs"]["content"]
        assert len(content) == 6
        assert s.ask(e)["choices"][0]["logprobs"] is None


def check_top_logprobs(s: Served, e: str) -> None:
    content = s.ask(e, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 3 for entry in content)
    error = error_of(post_json_with(s, e, top_logprobs=2), 400)
    assert error["param"] == "top_logprobs"


def check_echo(s: Served, e: str) -> None:
    result = s.ask(e, echo=True, logprobs=1)
    assert texts(result)[0] == PROMPT + texts(s.ask(e))[0]
    logprobs = result["choices"][0]["logprobs"]
    prompt_len = len(s.prompt_ids(e))
    assert logprobs["token_logprobs"][0] is None
    assert len(logprobs["tokens"]) == prompt_len + 6
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])


def check_prompt_logprobs(s: Served, e: str) -> None:
    result = s.ask(e, prompt_logprobs=1)
    entries = (
        result["choices"][0]["prompt_logprobs"] if e == "completions" else result["prompt_logprobs"]
    )
    ids = s.prompt_ids(e)
    assert len(entries) == len(ids)
    assert entries[0] is None
    assert all(str(ids[i]) in entry for i, entry in enumerate(entries) if entry is not None)


def check_cache_salt(s: Served, e: str) -> None:
    long = (
        {"prompt": LONG_PROMPT}
        if e == "completions"
        else {"messages": [{"role": "user", "content": LONG_PROMPT}]}
    )
    s.ask(e, cache_salt=f"{e}-one", **long)
    same = s.ask(e, cache_salt=f"{e}-one", **long)["usage"]["prompt_tokens_details"]
    other = s.ask(e, cache_salt=f"{e}-two", **long)["usage"]["prompt_tokens_details"]
    assert same["cached_tokens"] > 0
    assert other["cached_tokens"] == 0


def check_chat_template_kwargs(s: Served, e: str) -> None:
    """Variables reach the template: one it does not read is refused naming the field (that a
    variable it reads changes the prompt is tests/test_server_thinking.py's, SRV-093)."""
    assert texts(s.ask(e, chat_template_kwargs={})) == texts(s.ask(e))
    error = error_of(post_json_with(s, e, chat_template_kwargs={"no_such_variable": 1}), 400)
    assert error["param"] == "chat_template_kwargs"


def _constrained(
    field: str, value: Any, check: Callable[[str], object]
) -> Callable[[Served, str], None]:
    """A structured-output field holds: every text of n=3 samples at temperature 1 passes
    ``check`` (the constraints themselves are tests/test_server_structured.py's)."""

    def run(s: Served, e: str) -> None:
        result = s.ask(e, n=3, temperature=1.0, seed=0, max_tokens=40, **{field: value})
        for text in texts(result):
            assert check(text), (field, text)

    return run


def _tools_need_a_template(field: str, value: Any) -> Callable[[Served, str], None]:
    """This model's chat template never reads ``tools``: a request using the tool fields is
    refused saying so (the fields at work on Qwen3's template are
    tests/test_server_structured.py's, SRV-132..SRV-135)."""

    def run(s: Served, e: str) -> None:
        fields = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}
        fields[field] = value
        error = error_of(post_json_with(s, e, **fields), 400)
        assert "render tools" in error["message"] or "tool" in str(error["param"])

    return run


SHARED: dict[str, Callable[[Served, str], None]] = {
    "response_format": _constrained(
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "yn", "schema": {"enum": ["yes", "no"]}}},
        lambda t: json.loads(t) in ("yes", "no"),
    ),
    "structured_outputs": _constrained(
        "structured_outputs", {"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")
    ),
    "guided_json": _constrained("guided_json", {"enum": [1, 2]}, lambda t: json.loads(t) in (1, 2)),
    "guided_regex": _constrained("guided_regex", "[0-9]{3}", lambda t: re.fullmatch("[0-9]{3}", t)),
    "guided_choice": _constrained("guided_choice", ["up", "down"], lambda t: t in ("up", "down")),
    "guided_grammar": _constrained(
        "guided_grammar", 'start: "x" | "yz"', lambda t: t in ("x", "yz")
    ),
    "model": check_model,
    "temperature": check_temperature,
    "top_p": check_top_p,
    "top_k": check_top_k,
    "min_p": check_min_p,
    "seed": check_seed,
    "stop": check_stop,
    "n": check_n,
    "stream": check_stream,
    "stream_options": check_stream_options,
    "priority": check_priority,
    "request_id": check_request_id,
    "add_special_tokens": check_add_special_tokens,
    "ignore_eos": check_ignore_eos,
    "cache_salt": check_cache_salt,
    "best_of": check_best_of,
    "presence_penalty": _penalised("presence_penalty", 2.0),
    "frequency_penalty": _penalised("frequency_penalty", 2.0),
    "repetition_penalty": _penalised("repetition_penalty", 3.0),
    "logit_bias": check_logit_bias,
    "min_tokens": check_min_tokens,
    "stop_token_ids": check_stop_token_ids,
    "prompt_logprobs": check_prompt_logprobs,
    "include_stop_str_in_output": check_include_stop_str_in_output,
    "max_tokens": check_max_tokens,
    "logprobs": check_logprobs,
}
#: Every honored field of each endpoint and the check that it is honored.
HONORED: dict[str, dict[str, Callable[[Served, str], None]]] = {
    "completions": {**SHARED, "prompt": check_prompt, "echo": check_echo},
    "chat": {
        **SHARED,
        "messages": check_messages,
        "max_completion_tokens": check_max_completion_tokens,
        "top_logprobs": check_top_logprobs,
        "chat_template_kwargs": check_chat_template_kwargs,
        "add_generation_prompt": check_add_generation_prompt,
        "continue_final_message": check_continue_final_message,
        "tools": _tools_need_a_template("tool_choice", "none"),
        "tool_choice": _tools_need_a_template("tool_choice", "required"),
        "parallel_tool_calls": _tools_need_a_template("parallel_tool_calls", False),
    },
}


@pytest.mark.spec("SRV-100")
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_every_field_is_honored_or_refused(endpoint: str) -> None:
    """The request model's fields are exactly the honored ones checked here and the refused
    ones (a new field fails this until it is one or the other)."""
    fields = set(ENDPOINTS[endpoint].model_fields)
    refused = set(refused_fields(ENDPOINTS[endpoint]))
    noted = set(noted_fields(ENDPOINTS[endpoint]))
    honored = set(HONORED[endpoint])
    assert not honored & refused
    assert not noted & (honored | refused)
    every = honored | refused | noted
    assert fields == every, (fields - every, every - fields)


@pytest.mark.spec("SRV-100", "SRV-101")
@pytest.mark.parametrize(
    ("endpoint", "field"), [(e, f) for e in sorted(HONORED) for f in sorted(HONORED[e])]
)
def test_an_honored_field_changes_the_response(server: Served, endpoint: str, field: str) -> None:
    HONORED[endpoint][field](server, endpoint)


@pytest.mark.spec("SRV-100")
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_a_refused_field_is_answered_400_naming_it(server: Served, endpoint: str) -> None:
    """Each refused field with a value is 400 naming it; with a neutral value it is accepted."""
    for field, (_, neutral) in refused_fields(ENDPOINTS[endpoint]).items():
        error = error_of(post_json_with(server, endpoint, **{field: {"type": "json_object"}}), 400)
        assert (error["param"], error["code"]) == (field, "unsupported_field")
        assert field in error["message"]
        for value in neutral:
            response = post_json_with(server, endpoint, **{field: value})
            assert response.status_code == 200, (field, value, response.text)


# -- streaming -----------------------------------------------------------------------------------


def streamed(s: Served, endpoint: str, **fields: Any) -> dict[int, str]:
    """The text of each choice index, put together from a stream's deltas."""
    path = "completions" if endpoint == "completions" else "chat/completions"
    body = (
        {"prompt": PROMPT}
        if endpoint == "completions"
        else {"messages": [{"role": "user", "content": PROMPT}]}
    )
    body.update({"max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True, **fields})
    payloads = sse_payloads(httpx.post(f"{s.url}/v1/{path}", json=body, timeout=60).content)
    joined: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for payload in payloads[:-1]:
        for choice in json.loads(payload)["choices"]:
            delta = choice.get("text", choice.get("delta", {}).get("content")) or ""
            joined[choice["index"]] = joined.get(choice["index"], "") + delta
            if choice.get("finish_reason"):
                finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
    assert all(count == 1 for count in finishes.values())
    assert set(finishes) == set(joined)
    return joined


@pytest.mark.spec("SRV-102", "SRV-003")
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_stream_equals_the_whole_text_across_a_split_stop(server: Served, endpoint: str) -> None:
    """The reproduction: stop ``path\\n\\ndef`` on ``def read(path):``, greedy."""
    fields: dict[str, Any] = {"max_tokens": 24, "stop": ["path\n\ndef"], "ignore_eos": False}
    if endpoint == "completions":
        fields["prompt"] = "def read(path):"
    else:
        fields["messages"] = [{"role": "user", "content": "def read(path):"}]
    whole = texts(server.ask(endpoint, **fields))
    assert streamed(server, endpoint, **fields) == dict(enumerate(whole))
    if endpoint == "completions" and has_default_model():  # the model of the reproduction
        assert whole == [" return "]


@pytest.mark.spec("SRV-006")
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_parallel_choices_stream_like_they_return(server: Served, endpoint: str) -> None:
    """``n=2`` of two prompts (completions): choices 0..3 prompt by prompt, streamed or not,
    each with one finish reason."""
    fields: dict[str, Any] = {"n": 2, "temperature": 1.2, "seed": 3}
    if endpoint == "completions":
        fields["prompt"] = [PROMPT, "class Config:"]
    whole = texts(server.ask(endpoint, **fields))
    assert len(whole) == (4 if endpoint == "completions" else 2)
    assert streamed(server, endpoint, **fields) == dict(enumerate(whole))
    refused = post_json_with(server, endpoint, n=2, best_of=3, stream=True)
    assert error_of(refused, 400)["param"] == "best_of"


# -- the model's defaults -------------------------------------------------------------------------


@pytest.mark.spec("SRV-103")
def test_absent_fields_take_the_models_defaults(tmp_path: Path) -> None:
    model_dir = tiny_chat_model(tmp_path / "model")
    (model_dir / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3})
    )
    body = {"prompt": "def f", "ignore_eos": True}
    for source, tokens in (("auto", 3), ("vllm", 16)):
        engine = load_engine(model_dir, CONFIG, generation_config=source)
        with running(create_app(engine, MODEL, 1 << 16)) as server:
            results = [post_json(f"{server.url}/v1/completions", body).json() for _ in range(2)]
            greedy = post_json(
                f"{server.url}/v1/completions", {**body, "temperature": 0, "max_tokens": tokens}
            ).json()
        assert [token_count(r) for r in results] == [tokens, tokens]
        if source == "auto":
            assert texts(results[0]) == texts(results[1]) == texts(greedy)
