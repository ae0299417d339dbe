"""The OpenAI-compatible server, started for real on a free loopback port (SRV-001..SRV-032).

One uvicorn server runs in a background thread for the whole module; after every test the
engine must come back to no running or waiting request and no KV page in use (SRV-022).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from server_harness import (
    StepGate,
    error_of,
    metric,
    parse_prometheus,
    running,
    sse_events,
    wait_idle,
)
from serving_models import serving_model_dir

from pagedkv.backend import load_engine
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.params import SamplingParams
from pagedkv.entrypoints.cli.main import build_parser
from pagedkv.entrypoints.server.app import create_app
from pagedkv.entrypoints.server.async_engine import AsyncEngine
from pagedkv.interfaces import Engine
from pagedkv.testing.tiny_qwen3 import model_device

MODEL = "test-model"
MAX_BODY_BYTES = 8192
CONFIG = EngineConfig(page_size=8, num_pages=96, max_num_batched_tokens=256, max_model_len=512)
PROMPT = "def fibonacci(n):\n    if n < 2:\n"
#: Long enough to span several full pages, so a repeat reuses them.
LONG_PROMPT = "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n" * 3


@dataclass(frozen=True)
class Served:
    url: str
    bridge: AsyncEngine
    model_dir: Path
    gate: StepGate

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = serving_model_dir(tmp_path_factory)
    engine = load_engine(model_dir, CONFIG, device=model_device())
    gate = StepGate()
    engine.add_step_observer(gate)
    app = create_app(engine, MODEL, MAX_BODY_BYTES)
    with running(app) as server:
        yield Served(server.url, server.bridge, model_dir, gate)


@pytest.fixture
def server(served: Served) -> Iterator[Served]:
    """The module's server; checks SRV-022 after the test."""
    yield served
    wait_idle(served.bridge)


@pytest.fixture(scope="module")
def reference(served: Served) -> Engine:
    """An in-process engine on the same model and config: the Python API's outputs."""
    return load_engine(served.model_dir, CONFIG, device=model_device())


def offline(engine: Engine, prompts: list[str | list[int]], **params: Any) -> list[str]:
    outputs = run_to_completion(engine, prompts, SamplingParams(temperature=0.0, **params))
    return [o.text for o in outputs]


# -- completions and chat --------------------------------------------------------------------


@pytest.mark.spec("SRV-001", "SRV-004")
def test_completion_matches_python_api(server: Served, reference: Engine) -> None:
    client = server.client()
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.object == "text_completion"
    assert result.model == MODEL
    assert [c.text for c in result.choices] == offline(
        reference, [PROMPT], max_tokens=8, ignore_eos=True
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert reference.tokenizer is not None
    assert result.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPT))
    assert result.usage.completion_tokens == 8
    assert result.usage.total_tokens == result.usage.prompt_tokens + 8
    assert result.usage.prompt_tokens_details is not None
    assert result.usage.prompt_tokens_details.cached_tokens is not None


@pytest.mark.spec("SRV-001")
def test_completion_prompt_lists_give_one_choice_per_prompt(
    server: Served, reference: Engine
) -> None:
    client = server.client()
    texts = ["import os\n", "class Config:", "for i in range(3):"]
    result = client.completions.create(
        model=MODEL, prompt=texts, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == offline(
        reference, list(texts), max_tokens=5, ignore_eos=True
    )
    ids = [[5, 6, 7, 8], [9, 10]]
    by_ids = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in by_ids.choices] == offline(
        reference, list(ids), max_tokens=4, ignore_eos=True
    )
    assert by_ids.usage is not None
    assert by_ids.usage.prompt_tokens == 6


@pytest.mark.spec("SRV-004")
def test_repeated_prompt_reports_cached_tokens(server: Served) -> None:
    client = server.client()
    first = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    assert first.usage is not None
    assert second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens is not None
    full_pages = (second.usage.prompt_tokens - 1) // CONFIG.page_size * CONFIG.page_size
    assert details.cached_tokens >= full_pages > 0


@pytest.mark.spec("SRV-003")
def test_completion_stream_concatenates_to_the_text(server: Served) -> None:
    client = server.client()
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


@pytest.mark.spec("SRV-003")
def test_stream_is_server_sent_events_ending_with_done(server: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


@pytest.mark.spec("SRV-002", "SRV-003", "SRV-004")
def test_chat_matches_llm_chat_streamed_or_not(server: Served, reference: Engine) -> None:
    client = server.client()
    messages: list[Any] = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    tokenizer = reference.tokenizer
    assert tokenizer is not None
    expected = offline(
        reference, [tokenizer.apply_chat_template(messages)], max_tokens=6, ignore_eos=True
    )
    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=50,  # max_completion_tokens wins
        max_completion_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert [whole.choices[0].message.content] == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 6
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


@pytest.mark.spec("SRV-005")
def test_logprobs(server: Served) -> None:
    client = server.client()
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=3, extra_body={"ignore_eos": True}
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 4
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs
    assert content is not None
    assert content.content is not None
    assert len(content.content) == 3
    for entry in content.content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


@pytest.mark.spec("SRV-007")
def test_concurrent_requests_get_their_own_outputs(server: Served, reference: Engine) -> None:
    client = server.client()
    prompts = [f"def function_{i}(x):" for i in range(6)]
    expected = offline(reference, list(prompts), max_tokens=12, ignore_eos=True)

    def ask(prompt: str) -> str:
        result = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return result.choices[0].text

    steps_before = server.bridge.stats().steps
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(ask, prompts))
    assert texts == expected
    # served together: far fewer steps than one request after the other would take
    assert server.bridge.stats().steps - steps_before < 12 * len(prompts)


# -- errors and limits -------------------------------------------------------------------------


@pytest.mark.spec("SRV-010", "SRV-011")
def test_malformed_json_is_400(server: Served) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"model": "test-model", "prompt": ',
        headers={"Content-Type": "application/json"},
    )
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"
    missing = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL})
    assert error_of(missing, 400)["param"] == "messages"


@pytest.mark.spec("SRV-010", "SRV-012")
def test_unknown_model_is_404(server: Served) -> None:
    extras: tuple[tuple[str, dict[str, Any]], ...] = (
        ("completions", {"prompt": "x"}),
        ("chat/completions", {"messages": []}),
    )
    for path, extra in extras:
        body: dict[str, Any] = {"model": "gpt-4o", **extra}
        response = httpx.post(f"{server.url}/v1/{path}", json=body)
        if path == "chat/completions":  # an empty conversation is a schema error first
            error_of(response, 400)
            body["messages"] = [{"role": "user", "content": "hi"}]
            response = httpx.post(f"{server.url}/v1/{path}", json=body)
        error = error_of(response, 404)
        assert error["param"] == "model"
        assert error["code"] == "model_not_found"


@pytest.mark.spec("SRV-010", "SRV-013")
def test_oversized_body_is_413(server: Served) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY_BYTES}).encode()
    declared = httpx.post(
        f"{server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert error_of(declared, 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        for start in range(0, len(body), 1024):
            yield body[start : start + 1024]

    streamed = httpx.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        headers={"Content-Type": "application/json"},
    )
    error_of(streamed, 413)


@pytest.mark.spec("SRV-010", "SRV-014")
@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", -5), ("min_p", 2.0), ("max_tokens", 0)],
)
def test_invalid_sampling_values_are_400(server: Served, field: str, value: float) -> None:
    body = {"model": MODEL, "prompt": "x", field: value}
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=body), 400)
    assert error["param"] == field
    assert error["message"].startswith(f"{field} must be")


@pytest.mark.spec("SRV-010", "SRV-015")
def test_request_past_the_limit_is_400(server: Served) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": CONFIG.max_model_len}
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=body), 400)
    assert error["code"] == "context_length_exceeded"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}
    error = error_of(httpx.post(f"{server.url}/v1/chat/completions", json=chat), 400)
    assert error["code"] == "context_length_exceeded"


@pytest.mark.spec("SRV-006", "SRV-010")
def test_n_below_one_and_best_of_below_n_are_400(server: Served) -> None:
    body = {"model": MODEL, "prompt": "x", "n": 0}
    assert error_of(httpx.post(f"{server.url}/v1/completions", json=body), 400)["param"] == "n"
    body = {"model": MODEL, "prompt": "x", "n": 3, "best_of": 2}
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=body), 400)
    assert error["param"] == "best_of"


# -- request lifetime ---------------------------------------------------------------------------


def _finished(metrics_text: str, reason: str) -> float:
    return metric(
        metrics_text, "vllm:request_success_total", model_name=MODEL, finished_reason=reason
    )


@pytest.mark.spec("SRV-020", "SRV-022")
def test_disconnect_mid_stream_aborts_and_frees_pages(server: Served) -> None:
    """The client reads the first event, checks that the request holds pages, and goes.

    Two races are closed: the engine is held in the request's second step until the client
    has gone, so the request cannot finish on its own before a slow client reads its first
    event (nothing else holds a generation back while its client reads); and the client keeps
    its chunk iterator until it means to go, since dropping it closes the connection, which
    could abort the request before the check."""
    metrics_before = httpx.get(f"{server.url}/metrics").text
    body = {
        "model": MODEL,
        "prompt": LONG_PROMPT,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,  # every step is an event, the text of a token or not
    }
    server.gate.hold_after(2)
    try:
        url = f"{server.url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()  # kept: dropping it would close the connection here
            first = next(chunks)
            assert server.gate.held.wait(10), "the second step never ran"
            assert server.bridge.stats().pages_in_use > 0, (first, server.bridge.stats())
    finally:
        server.gate.release()
    stats = wait_idle(server.bridge, timeout=10)
    assert stats.pages_in_use == 0
    assert stats.running == 0
    metrics_after = httpx.get(f"{server.url}/metrics").text
    assert _finished(metrics_after, "abort") == _finished(metrics_before, "abort") + 1
    assert _finished(metrics_after, "length") == _finished(metrics_before, "length")


@pytest.mark.spec("SRV-021", "SRV-022")
def test_disconnect_before_a_plain_response_aborts(server: Served) -> None:
    """The engine is held in the request's first step until the client has timed out."""
    metrics_before = httpx.get(f"{server.url}/metrics").text
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 400, "ignore_eos": True}
    server.gate.hold_after(1)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
        assert server.gate.held.is_set()
    finally:
        server.gate.release()
    wait_idle(server.bridge, timeout=10)
    metrics_after = httpx.get(f"{server.url}/metrics").text
    assert _finished(metrics_after, "abort") == _finished(metrics_before, "abort") + 1
    assert _finished(metrics_after, "length") == _finished(metrics_before, "length")


# -- operations ---------------------------------------------------------------------------------


@pytest.mark.spec("SRV-031", "SRV-080")
def test_metrics_is_prometheus_text_tracking_the_engine(server: Served) -> None:
    client = server.client()
    client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
    )
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    types, samples = parse_prometheus(response.text)
    stats = server.bridge.stats()
    assert samples["pagedkv_kv_pages_total"] == CONFIG.num_pages == stats.num_pages
    for name in ("in_use", "free", "cached"):
        assert samples[f"pagedkv_kv_pages_{name}"] == getattr(stats, f"pages_{name}")
    assert samples["pagedkv_kv_pages_in_use"] == 0
    assert samples["pagedkv_prefix_cache_hit_rate"] == pytest.approx(stats.hit_rate)
    assert types["pagedkv_kv_pages_in_use"] == "gauge"
    model = f'{{model_name="{MODEL}"}}'
    assert samples[f"vllm:num_requests_running{model}"] == 0
    assert samples[f"vllm:num_requests_waiting{model}"] == 0
    assert samples[f"vllm:kv_cache_usage_perc{model}"] == 0
    assert samples[f"vllm:num_preemptions_total{model}"] == stats.preemptions
    assert samples[f"vllm:prefix_cache_queries_total{model}"] == stats.query_tokens
    assert samples[f"vllm:prefix_cache_hits_total{model}"] == stats.hit_tokens
    assert samples[f"vllm:generation_tokens_total{model}"] >= 3
    assert types["vllm:generation_tokens_total"] == "counter"
    for family in (
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert types[family] == "histogram"
        count = samples[f"{family}_count{model}"]
        assert count >= 1
        assert samples[f'{family}_bucket{{le="+Inf",model_name="{MODEL}"}}'] == count
    # the 3-token request: 2 gaps between its tokens
    assert samples[f"vllm:time_per_output_token_seconds_count{model}"] >= 2
    assert samples["process_resident_memory_bytes"] > 0  # process metrics
    assert types["process_cpu_seconds_total"] == "counter"


@pytest.mark.spec("SRV-030")
def test_models_and_health(server: Served) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}


@pytest.mark.spec("SRV-032")
def test_serve_listens_on_loopback_by_default() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"
