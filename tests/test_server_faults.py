"""One request's failure is that request's alone, over the real server (SRV-023..025, SRV-058).

Faults are injected into the engine's collaborators (:mod:`pagedkv.testing.faults`): a runner
that raises, a stand-in model poisoning one request, a tokenizer raising on one request's
text; or the engine's ``step`` itself raises, as an engine without isolation would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from chaos import ChaosConfig, run_chaos
from fastapi.testclient import TestClient
from server_harness import Running, error_of, metric, running, sse_events, sse_payloads, wait_idle
from serving_models import write_tokenizer

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.llm import run_to_completion
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.entrypoints.server.app import ServerConfig, create_app
from pagedkv.interfaces import KVManagerConfig, StepRunner
from pagedkv.testing.faults import FaultyRunner, FaultyTokenizer, PoisonedRunner
from pagedkv.testing.hash_runner import HashRunner

MODEL = "test-model"
CONFIG = EngineConfig(page_size=4, num_pages=256, max_num_seqs=40, max_model_len=128)
BODY: dict[str, Any] = {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 4}
QUIET = ServerConfig(log_stats_interval_s=None)


def app_over(runner: StepRunner, tokenizer: Tokenizer | None = None) -> Any:
    engine = reference_backend().create_engine(runner, CONFIG, tokenizer=tokenizer)
    return create_app(engine, MODEL, config=QUIET)


def stream_events(client: TestClient, body: dict[str, Any]) -> list[str]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        return sse_events(stream.iter_lines())


def assert_error_event(events: list[str], code: str) -> str:
    """The stream ended with an error event of ``code`` then ``[DONE]``, and no choice of it
    finished; the error's message."""
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == code
    chunks = [json.loads(e) for e in events[:-2]]
    assert not any(c["choices"][0]["finish_reason"] for c in chunks)
    return str(error["message"])


# -- a step that raises ---------------------------------------------------------------------------


class RaisingEngine(LLMEngine):
    """The reference engine, but ``step()`` raises while ``raises`` is above 0 (counting down;
    -1 for ever): an engine that does not isolate its failures."""

    raises = 0

    def step(self) -> list[RequestOutput]:
        if self.raises:
            self.raises -= self.raises > 0
            raise RuntimeError("device lost")
        return super().step()


@pytest.mark.spec("SRV-023", "SRV-022")
def test_a_step_that_raises_is_stepped_again_until_three_in_a_row() -> None:
    kv = reference_backend().create_kv_manager(KVManagerConfig(CONFIG.num_pages, CONFIG.page_size))
    engine = RaisingEngine(
        HashRunner(64, CONFIG.num_pages, CONFIG.page_size), CONFIG, kv_manager=kv
    )
    app = create_app(engine, MODEL, config=QUIET)
    with TestClient(app) as client:
        bridge = app.state.server.engine
        engine.raises = 2  # two in a row: stepped again, nobody fails
        ok = client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4
        assert engine.raises == 0
        engine.raises = -1  # for ever: after three, what is in flight fails
        assert error_of(client.post("/v1/completions", json=BODY), 500)["code"] == "engine_failure"
        assert_error_event(stream_events(client, BODY), "engine_failure")
        assert wait_idle(bridge).pages_in_use == 0
        engine.raises = 0
        again = client.post("/v1/completions", json=BODY)
        assert again.status_code == 200, again.text
        assert client.get("/health").status_code == 200


# -- a request the engine fails -------------------------------------------------------------------


@pytest.mark.spec("SRV-024", "SRV-022")
def test_a_request_the_engine_fails_is_500_and_serving_goes_on() -> None:
    """While the runner fails, each request fails after the engine's retries: 500
    ``request_failed`` with the engine's message, or that error event in a stream."""
    runner = FaultyRunner(HashRunner(64, CONFIG.num_pages, CONFIG.page_size))
    app = app_over(runner)
    with TestClient(app) as client:
        bridge = app.state.server.engine
        runner.failing = True
        error = error_of(client.post("/v1/completions", json=BODY), 500)
        assert error["code"] == "request_failed"
        assert error["type"] == "server_error"
        assert "3 steps running it alone failed" in error["message"]
        assert "InjectedFault" in error["message"]
        assert_error_event(stream_events(client, BODY), "request_failed")
        assert wait_idle(bridge).pages_in_use == 0
        runner.failing = False
        ok = client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4
        metrics = client.get("/metrics").text
        assert metric(metrics, "pagedkv_engine_failed_steps_total") == 6
        errors = metric(
            metrics, "vllm:request_success_total", model_name=MODEL, finished_reason="error"
        )
        assert errors == 2


POISON = (60, 61, 62, 63)


@pytest.mark.spec("SRV-024", "SRV-022")
def test_a_poisoned_prompt_fails_its_submission_alone() -> None:
    """Every step holding the poisoned prompt raises. The three-prompt request carrying it is
    answered 500 and its other prompts are aborted, after three steps that ran it alone
    failed; another client's request sent at the same time gets exactly its tokens of a run
    without the poison."""
    poisoned = PoisonedRunner(64, CONFIG.num_pages, CONFIG.page_size, poison=POISON, kind="raise")
    app = app_over(poisoned)
    other = {"prompt": [9, 8, 7, 6, 5], "max_tokens": 12, "temperature": 0, "logprobs": 0}
    clean = reference_backend().create_engine(HashRunner(64, CONFIG.num_pages, 4), CONFIG)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    (want,) = run_to_completion(clean, [other["prompt"]], greedy)
    batch = {**BODY, "prompt": [[1, 2, 3], [*POISON, 1], [4, 5, 6]], "max_tokens": 40}
    with running(app) as server, ThreadPoolExecutor(2) as pool:
        url = f"{server.url}/v1/completions"
        failing = pool.submit(httpx.post, url, json=batch, timeout=60)
        fine = pool.submit(httpx.post, url, json=other, timeout=60)
        error = error_of(failing.result(), 500)
        assert error["code"] == "request_failed"
        reply = fine.result()
        assert reply.status_code == 200, reply.text
        tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
        assert tokens == [f"token_id:{t}" for t in want.token_ids]
        assert wait_idle(server.bridge).pages_in_use == 0
        # the steps it shared were halved, charged to no one; three failed with it alone
        assert len([i for i in poisoned.raised if len(poisoned.keys[i]) == 1]) == 3


# -- one poisoned stream among 31 (SRV-058) -------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, int]:
    """A small BPE tokenizer and its vocabulary size."""
    directory = tmp_path_factory.mktemp("tokenizer")
    vocab = write_tokenizer(directory)
    return Tokenizer(directory), vocab


def poisoned_runner(vocab: int) -> PoisonedRunner:
    """Poisoned requests produce the token ``vocab - 2`` and have ``vocab - 1`` next; no other
    request produces either."""
    return PoisonedRunner(
        vocab,
        CONFIG.num_pages,
        CONFIG.page_size,
        poison=POISON,
        kind="tokens",
        reserved=[vocab - 2, vocab - 1],
    )


@pytest.fixture
def poisoned_server(
    request: pytest.FixtureRequest, tokenizer: tuple[Tokenizer, int]
) -> Iterator[tuple[Running, str]]:
    """The server, its tokenizer raising on the poisoned request's text (``stop``) or on the
    text of its second-best token, which only its logprobs hold (``logprobs``)."""
    inner, vocab = tokenizer
    produced, second = vocab - 2, vocab - 1
    kind: str = request.param
    if kind == "stop":
        faulty = FaultyTokenizer(inner, lambda ids: produced in ids)
    else:
        faulty = FaultyTokenizer(inner, lambda ids: list(ids) == [second])
    with running(app_over(poisoned_runner(vocab), faulty)) as server:
        yield server, kind
    assert faulty.faults >= 1


def innocent(i: int, tokenizer: Tokenizer) -> dict[str, Any]:
    prompt = tokenizer.encode(f"def function_{i}(x):")
    assert tuple(prompt[: len(POISON)]) != POISON
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0.8,
        "seed": i,
        "stop": ["\x00never"],
        "stream": True,
    }


@pytest.mark.spec("SRV-058", "SRV-024", "SRV-022")
@pytest.mark.parametrize("poisoned_server", ["stop", "logprobs"], indirect=True)
def test_a_poisoned_stream_fails_none_of_31_others(
    poisoned_server: tuple[Running, str], tokenizer: tuple[Tokenizer, int]
) -> None:
    """The poisoned stream's stop strings (or its logprobs' token texts) cannot be decoded:
    it gets the error event; the 31 others get exactly the text of a run without it."""
    server, kind = poisoned_server
    inner, vocab = tokenizer
    url = f"{server.url}/v1/completions"
    bodies = [innocent(i, inner) for i in range(32)]
    poison: dict[str, Any] = {
        "prompt": [*POISON, 5, 6],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    if kind == "stop":
        poison["stop"] = ["zz"]
    else:
        poison["logprobs"] = 2
    clean = reference_backend().create_engine(poisoned_runner(vocab), CONFIG, tokenizer=inner)
    expected = run_to_completion(
        clean,
        [b["prompt"] for b in bodies],
        [
            SamplingParams(max_tokens=8, temperature=0.8, seed=i, stop=("\x00never",))
            for i in range(32)
        ],
    )
    bodies[13] = poison

    def stream(body: dict[str, Any]) -> list[str]:
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200
        return sse_payloads(response.content)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(stream, bodies))
    message = assert_error_event(results[13], "request_failed")
    where = "detokenizing failed" if kind == "stop" else "serving its output failed"
    assert where in message
    assert "InjectedFault" in message
    for i, events in enumerate(results):
        if i == 13:
            continue
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected[i].text
    assert wait_idle(server.bridge).pages_in_use == 0


# -- under load (SRV-025) -------------------------------------------------------------------------


@pytest.mark.spec("SRV-025", "SRV-020", "SRV-021", "SRV-022")
def test_runner_faults_poisons_and_disconnects_under_load() -> None:
    """300 requests from 32 clients at once; 1 step in 50 raises; 1 request in 50 is poisoned;
    1 in 10 disconnects. ``make chaos`` runs ten times as many."""
    report = run_chaos(ChaosConfig(requests=300, concurrency=32))
    assert report.faults_injected > report.poisoned * 3  # random faults happened too
    assert report.poisoned == 6
    assert report.failed >= report.poisoned
    assert report.disconnected >= 20
    assert report.failed_wrongly == 0, report.lines()
    assert report.finished_wrongly == 0, report.lines()
    assert report.wrong_outputs == 0, report.lines()
    assert report.pages_in_use_after == 0
    assert report.failed_steps_reported == report.faults_injected
    assert report.ok
