"""Float request fields at the server (SRV-105): non-finite numbers, in any JSON spelling
Python's reader accepts, and sampling values float32 cannot hold are answered 400 naming the
field; values vLLM's server takes are served.

One server on a tiny chat model runs for the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import Running, error_of, post_json, running, wait_idle
from serving_models import tiny_chat_model

from pagedkv.backend import load_engine
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.server.app import create_app

MODEL = "tiny"
CONFIG = EngineConfig(page_size=8, num_pages=64, max_model_len=256)
FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    model_dir: Path = tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    with running(create_app(load_engine(model_dir, CONFIG), MODEL)) as served:
        yield served
        wait_idle(served.bridge)


def raw(url: str, path: str, body: str) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{url}{path}", content=body.encode(), headers=headers, timeout=30)


@pytest.mark.spec("SRV-105")
@pytest.mark.parametrize("field", [*FIELDS, "repetition_penalty"])
@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_are_400_naming_the_field(
    server: Running, field: str, token: str
) -> None:
    """Catches ``temperature: Infinity`` accepted (Python's JSON reader takes the token, and
    pydantic's floats allow it by default), on both endpoints."""
    completion = raw(server.url, "/v1/completions", f'{{"prompt": "a", "{field}": {token}}}')
    assert error_of(completion, 400)["param"] == field
    messages = '[{"role": "user", "content": "hi"}]'
    chat = raw(
        server.url, "/v1/chat/completions", f'{{"messages": {messages}, "{field}": {token}}}'
    )
    assert error_of(chat, 400)["param"] == field


@pytest.mark.spec("SRV-105")
def test_a_non_finite_logit_bias_is_400(server: Running) -> None:
    """Catches a NaN bias slipping into the logits, where it makes every row NaN."""
    response = raw(server.url, "/v1/completions", '{"prompt": "a", "logit_bias": {"5": NaN}}')
    assert error_of(response, 400)["param"].startswith("logit_bias")


@pytest.mark.spec("SRV-105")
@pytest.mark.parametrize(
    ("field", "value"),
    [("repetition_penalty", 5e-324), ("repetition_penalty", 1e-40), ("temperature", 1e39)],
)
def test_values_float32_cannot_hold_are_400(server: Running, field: str, value: float) -> None:
    """Catches the reproduction: ``repetition_penalty=5e-324`` passed (it is > 0 in float64)
    and the reply was one empty token with finish reason ``stop``."""
    body = {"prompt": "def f(x):", "max_tokens": 4, field: value}
    assert error_of(post_json(f"{server.url}/v1/completions", body), 400)["param"] == field


@pytest.mark.spec("SRV-105")
@pytest.mark.parametrize(
    "fields",
    [
        {"top_p": 5e-324, "temperature": 1.0},
        {"temperature": 3.0},
        {"temperature": 1e30},
        {"repetition_penalty": 1e-30},
        {"min_p": 5e-324},
    ],
)
def test_values_vllm_takes_are_served(server: Running, fields: dict[str, float]) -> None:
    """Catches a range narrower than vLLM's and the silent empty output: each is served, and
    a ``top_p`` of 5e-324 gives the greedy text (the most likely token at each step)."""
    body = {"prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True, "seed": 3, **fields}
    response = post_json(f"{server.url}/v1/completions", body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 4
    if "top_p" in fields:
        greedy = {"prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        expected = post_json(f"{server.url}/v1/completions", greedy).json()["choices"][0]["text"]
        assert choice["text"] == expected


@pytest.mark.spec("SRV-105")
def test_a_logit_bias_past_100_is_clamped_as_vllm_does(server: Running) -> None:
    """Catches a bias of 150 refused (vLLM's server clamps it to 100 and serves it): the
    output equals that of a bias of 100, and a bias of -1e308 that of -100."""
    url = f"{server.url}/v1/completions"
    base = {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    greedy = post_json(url, base).json()["choices"][0]["text"]
    for far, near in ((150.0, 100.0), (-1e308, -100.0)):
        token = "5" if far > 0 else "0"
        answers = [post_json(url, {**base, "logit_bias": {token: bias}}) for bias in (far, near)]
        assert all(a.status_code == 200 for a in answers), answers[0].text
        texts = [a.json()["choices"][0]["text"] for a in answers]
        assert texts[0] == texts[1]
    assert greedy  # the base request is served too
