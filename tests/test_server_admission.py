"""Admission control and one client's requests against everyone else's (SRV-057,
SRV-060..SRV-065): prompts per request, queue depth, deadlines, read timeouts against
slowloris clients, graceful shutdown, and the reproductions of issue reports.

Most tests run the hash stand-in model slowed to a known time per step, so that requests stay
queued or in flight as long as a test needs; the reproductions run a tiny Qwen3 chat model.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from server_harness import (
    Running,
    error_of,
    metric,
    post_json,
    running,
    sse_events,
    sse_payloads,
    wait_idle,
)
from serving_models import tiny_chat_model

from pagedkv.backend import load_engine, reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.cli.main import build_parser
from pagedkv.entrypoints.server.admission import AdmissionLimits
from pagedkv.entrypoints.server.app import DEFAULT_MAX_BODY_BYTES, ServerConfig, create_app
from pagedkv.entrypoints.server.http import HTTPOptions
from pagedkv.plan import StepPlan
from pagedkv.testing.hash_runner import HashRunner

MODEL = "test-model"
#: Seconds each step of the slowed stand-in model takes.
STEP_S = 0.02
SLOW_CONFIG = EngineConfig(page_size=4, num_pages=256, max_num_seqs=2, max_model_len=1024)


class SlowRunner(HashRunner):
    """The hash stand-in model, taking :data:`STEP_S` seconds per step."""

    def execute(self, plan: StepPlan) -> torch.Tensor:
        time.sleep(STEP_S)
        return super().execute(plan)


def slow_app(limits: AdmissionLimits | None = None) -> Any:
    runner = SlowRunner(
        vocab_size=64, num_pages=SLOW_CONFIG.num_pages, page_size=SLOW_CONFIG.page_size
    )
    config = ServerConfig(limits=limits or AdmissionLimits(), log_stats_interval_s=None)
    return create_app(reference_backend().create_engine(runner, SLOW_CONFIG), MODEL, config=config)


def ids_body(num_prompts: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    prompts = [[1 + i, 2, 3, 4, 5] for i in range(num_prompts)]
    return {"prompt": prompts, "max_tokens": max_tokens, **extra}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def tiny_server(model_dir: Path) -> Iterator[Running]:
    """A tiny chat model behind the default limits."""
    config = EngineConfig(page_size=8, num_pages=128, max_model_len=256)
    app = create_app(load_engine(model_dir, config), MODEL)
    with running(app) as server:
        yield server


# -- prompts per request and queue depth ---------------------------------------------------------


@pytest.mark.spec("SRV-060")
def test_more_prompts_than_a_request_may_carry_is_400(tiny_server: Running) -> None:
    limit = AdmissionLimits().max_prompts_per_request
    url = f"{tiny_server.url}/v1/completions"
    error = error_of(post_json(url, {"prompt": ["x"] * (limit + 1), "max_tokens": 1}), 400)
    assert error["param"] == "prompt"
    assert error["code"] == "too_many_prompts"
    assert str(limit) in error["message"]
    at_limit = post_json(url, {"prompt": ["x"] * limit, "max_tokens": 1})
    assert at_limit.status_code == 200, at_limit.text
    assert len(at_limit.json()["choices"]) == limit
    wait_idle(tiny_server.bridge)


@pytest.mark.spec("SRV-060")
def test_a_limit_past_the_queue_is_refused() -> None:
    with pytest.raises(ValueError, match="max_prompts_per_request"):
        AdmissionLimits(max_prompts_per_request=10, max_waiting_requests=5)


@pytest.mark.spec("SRV-065")
def test_3000_prompts_never_stall_another_clients_request(tiny_server: Running) -> None:
    url = f"{tiny_server.url}/v1/completions"
    big = {"prompt": [f"def f{i}(x):" for i in range(3000)], "max_tokens": 16}
    assert 30_000 < len(json.dumps(big)) < 60_000  # the reported 36 KB request
    small = {"prompt": "import os\n", "max_tokens": 8, "ignore_eos": True}
    steps_before = tiny_server.bridge.stats().steps
    with ThreadPoolExecutor(2) as pool:
        big_reply = pool.submit(post_json, url, big)
        small_reply = pool.submit(post_json, url, small)
        refused, answered = big_reply.result(), small_reply.result()
    error_of(refused, 400)
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["completion_tokens"] == 8
    # served in the steps its own 8 tokens need, not behind thousands of other prompts
    assert tiny_server.bridge.stats().steps - steps_before <= 10
    wait_idle(tiny_server.bridge)


@pytest.mark.spec("SRV-061")
def test_a_full_queue_is_429_with_retry_after() -> None:
    app = slow_app(AdmissionLimits(max_prompts_per_request=6, max_waiting_requests=6))
    with running(app) as server:
        url = f"{server.url}/v1/completions"
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post_json, url, ids_body(6, 20, ignore_eos=True))
            deadline = time.monotonic() + 10
            while server.bridge.stats().running < 2:  # 2 running (max_num_seqs), 4 waiting
                assert time.monotonic() < deadline, "the first request was never scheduled"
                time.sleep(0.005)
            refused = post_json(url, ids_body(3, 1))
            error = error_of(refused, 429)
            assert error["code"] == "queue_full"
            assert error["type"] == "rate_limit_error"
            assert refused.headers["retry-after"] == "1"
            fits = post_json(url, ids_body(2, 1))  # 4 waiting + 2 is the limit
            assert fits.status_code == 200, fits.text
            assert first.result().status_code == 200
        wait_idle(server.bridge)
        again = post_json(url, ids_body(3, 1))  # the queue drained: accepted again
        assert again.status_code == 200, again.text
        wait_idle(server.bridge)


@pytest.mark.spec("SRV-080", "ENG-053")
def test_queue_time_counts_the_wait_for_a_sequence_slot() -> None:
    """Four prompts, two sequences a step, ten tokens each: the last two wait at least the ten
    steps of the first two, and ``vllm:request_queue_time_seconds`` adds that up."""
    with running(slow_app()) as server:
        reply = post_json(f"{server.url}/v1/completions", ids_body(4, 10, ignore_eos=True))
        assert reply.status_code == 200, reply.text
        wait_idle(server.bridge)
        text = httpx.get(f"{server.url}/metrics").text
    count = metric(text, "vllm:request_queue_time_seconds_count", model_name=MODEL)
    total = metric(text, "vllm:request_queue_time_seconds_sum", model_name=MODEL)
    assert count == 4
    assert total >= 2 * 10 * STEP_S
    e2e = metric(text, "vllm:e2e_request_latency_seconds_sum", model_name=MODEL)
    assert total < e2e


# -- deadlines -----------------------------------------------------------------------------------


@pytest.mark.spec("SRV-062")
def test_a_request_past_its_deadline_is_aborted_and_freed() -> None:
    app = slow_app(AdmissionLimits(request_timeout_s=0.3))
    with running(app) as server:
        url = f"{server.url}/v1/completions"
        before = httpx.get(f"{server.url}/metrics").text
        aborted = metric(before, "vllm:request_success_total", model_name=MODEL,
                         finished_reason="abort")  # fmt: skip
        slow = ids_body(1, 500, ignore_eos=True)
        error = error_of(post_json(url, slow), 504)
        assert error["code"] == "deadline_exceeded"
        with httpx.stream("POST", url, json={**slow, "stream": True}, timeout=30) as response:
            assert response.status_code == 200
            events = sse_events(response.iter_lines())
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "deadline_exceeded"
        assert wait_idle(server.bridge).pages_in_use == 0
        after = httpx.get(f"{server.url}/metrics").text
        assert metric(after, "vllm:request_success_total", model_name=MODEL,
                      finished_reason="abort") == aborted + 2  # fmt: skip
        quick = post_json(url, ids_body(2, 3))
        assert quick.status_code == 200, quick.text


# -- slow clients --------------------------------------------------------------------------------

READ_TIMEOUT_S = 0.4


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closed ``sock`` while we send one byte of ``trickle`` every
    50 ms (a slowloris client); ``None`` if it was still open after ``seconds``."""
    start = time.monotonic()
    sock.settimeout(0.05)
    position = 0
    while time.monotonic() - start < seconds:
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except OSError:
            return time.monotonic() - start
        if position < len(trickle):
            try:
                sock.sendall(trickle[position : position + 1])
            except OSError:
                return time.monotonic() - start
            position += 1
    return None


@pytest.mark.spec("SRV-063")
def test_slow_clients_are_disconnected() -> None:
    options = HTTPOptions(
        port=0, log_level="warning", header_timeout_s=READ_TIMEOUT_S, body_timeout_s=READ_TIMEOUT_S
    )
    body = json.dumps(ids_body(1, 2)).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with running(slow_app(), options) as server:
        endless_headers = b"X-Padding: " + b"a" * 200

        def connect() -> socket.socket:
            return socket.create_connection(("127.0.0.1", server.port))

        with connect() as silent:  # connects and sends nothing
            assert closed_within(silent, 10 * READ_TIMEOUT_S) is not None
        with connect() as loris:  # a header byte every 50 ms, never the blank line
            loris.sendall(head[:40])
            assert closed_within(loris, 10 * READ_TIMEOUT_S, endless_headers) is not None
        with connect() as slow_body:  # headers, then a body byte every 50 ms
            slow_body.sendall(head + body[:5])
            assert closed_within(slow_body, 10 * READ_TIMEOUT_S, body[5:] * 50) is not None
        with connect() as reused:  # one whole request, then a slow second one
            reused.sendall(head + body)
            reused.settimeout(10)
            assert reused.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(0.05)
            reused.sendall(head[:20])
            assert closed_within(reused, 10 * READ_TIMEOUT_S, endless_headers) is not None
        wait_idle(server.bridge)
        text = httpx.get(f"{server.url}/metrics").text
        assert metric(text, "vllm:request_success_total", model_name=MODEL,
                      finished_reason="length") == 1  # fmt: skip
        # ^ only the one whole request ran: the cut-off ones queued nothing
        assert metric(text, "vllm:e2e_request_latency_seconds_count", model_name=MODEL) == 1
        ok = post_json(f"{server.url}/v1/completions", ids_body(1, 2))
        assert ok.status_code == 200, ok.text


# -- graceful shutdown ---------------------------------------------------------------------------


@pytest.mark.spec("SRV-064")
def test_a_draining_server_refuses_new_work_with_503() -> None:
    app = slow_app()
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        app.state.server.engine.stop_admitting()
        refused = client.post("/v1/completions", json=ids_body(1, 2))
        assert error_of(refused, 503)["code"] == "unavailable"
        assert refused.headers["retry-after"] == "5"
        health = client.get("/health")
        assert health.status_code == 503
        assert health.headers["retry-after"] == "5"


def stream_events(url: str, body: dict[str, Any], started: threading.Event) -> list[str]:
    """The events of a streamed request until the stream ends, however it ends; sets
    ``started`` at the first event. (The stand-in model has no tokenizer: asking for logprobs
    makes every step an event.)"""
    events: list[str] = []
    body = {**body, "stream": True, "logprobs": 0}
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    started.set()
    except httpx.HTTPError:
        pass  # cut off by the shutdown
    started.set()
    return events


@pytest.mark.spec("SRV-064")
def test_shutdown_finishes_short_requests_aborts_long_ones_and_frees_pages() -> None:
    options = HTTPOptions(port=0, log_level="warning", shutdown_timeout_s=1)
    with running(slow_app(), options) as server:
        url = f"{server.url}/v1/completions"
        with ThreadPoolExecutor(2) as pool:
            started = [threading.Event(), threading.Event()]
            short = pool.submit(stream_events, url, ids_body(1, 15, ignore_eos=True), started[0])
            long = pool.submit(stream_events, url, ids_body(1, 1000, ignore_eos=True), started[1])
            assert all(event.wait(20) for event in started)
            begun = time.monotonic()
            server.server.handle_exit(signal.SIGTERM, None)
            try:
                late = httpx.post(url, json=ids_body(1, 2), timeout=10)
                assert late.status_code == 503  # if it got in before the listener closed
            except httpx.TransportError:
                pass  # the listener had closed
            short_events, long_events = short.result(), long.result()
            server.thread.join(30)
            took = time.monotonic() - begun
        assert not server.thread.is_alive()
        assert took < options.shutdown_timeout_s + 10
        assert short_events[-1] == "[DONE]"
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        assert "[DONE]" not in long_events[:-1]
        assert not any(
            json.loads(e).get("choices", [{}])[0].get("finish_reason") == "length"
            for e in long_events
            if e != "[DONE]"
        )
        stats = server.bridge.stats()
        assert not server.bridge.is_running
        assert stats.pages_in_use == 0
        assert stats.running == stats.waiting == 0


# -- one bad request among many ------------------------------------------------------------------


@pytest.mark.spec("SRV-057")
def test_a_poison_temperature_fails_none_of_31_other_streams(tiny_server: Running) -> None:
    url = f"{tiny_server.url}/v1/completions"

    def stream(i: int) -> list[str]:
        body: dict[str, Any] = {
            "prompt": f"def function_{i}(x):",
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
            "temperature": 1e-40 if i == 13 else 0.8,
            "seed": i,
        }
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200
        return sse_payloads(response.content)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(stream, range(32)))
    for events in results:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    wait_idle(tiny_server.bridge)


@pytest.mark.spec("SRV-066")
def test_serve_flags_default_to_the_servers_own_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    limits = AdmissionLimits()
    http = HTTPOptions()
    assert args.max_prompts_per_request == limits.max_prompts_per_request == 64
    assert args.max_waiting_requests == limits.max_waiting_requests == 256
    assert args.request_timeout is limits.request_timeout_s is None
    assert args.header_timeout == http.header_timeout_s == 10
    assert args.body_timeout == http.body_timeout_s == 30
    assert args.shutdown_timeout == http.shutdown_timeout_s == 30
    assert args.max_body_bytes == DEFAULT_MAX_BODY_BYTES
    assert args.log_stats_interval == ServerConfig().log_stats_interval_s
    assert args.api_key is None
    assert not args.cache_salt_per_api_key
    keys = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b"]).api_key
    assert keys == ["a", "b"]
