"""The server's request surface as a vLLM user meets it (SRV-050..SRV-055, SRV-080..SRV-083):
optional ``model``, ``/tokenize``, ``/detokenize``, ``/version``, unknown fields logged, bad
seeds and invalid Unicode answered 400, metrics, logging and ``python -m pagedkv``.

One server on a tiny chat model runs for the whole module.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from server_harness import Running, error_of, post_json, running, wait_idle
from serving_models import tiny_chat_model

from pagedkv import __version__
from pagedkv.backend import load_engine
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.entrypoints.cli.main import build_parser
from pagedkv.entrypoints.server.app import ServerConfig, create_app

MODEL = "tiny"
CONFIG = EngineConfig(page_size=8, num_pages=64, max_model_len=256)
PROMPT = "def fibonacci(n):\n"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Running]:
    app = create_app(load_engine(model_dir, CONFIG), MODEL)
    with running(app) as server:
        yield server


@pytest.fixture
def server(served: Running) -> Iterator[Running]:
    yield served
    wait_idle(served.bridge)


# -- model optional, served model name ----------------------------------------------------------


@pytest.mark.spec("SRV-050")
def test_model_may_be_absent(server: Running) -> None:
    completion = post_json(f"{server.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == MODEL
    chat = post_json(f"{server.url}/v1/chat/completions", {"messages": CHAT, "max_tokens": 3})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == MODEL
    named = post_json(
        f"{server.url}/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    )
    assert named.status_code == 200
    other = post_json(f"{server.url}/v1/completions", {"model": "gpt-4o", "prompt": PROMPT})
    assert error_of(other, 404)["param"] == "model"


@pytest.mark.spec("SRV-050")
def test_served_model_name_is_listed_and_answered(model_dir: Path) -> None:
    args = build_parser().parse_args(["serve", "--served-model-name", "alias"])
    assert args.served_model_name == "alias"
    app = create_app(load_engine(model_dir, CONFIG), args.served_model_name)
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["alias"]
        body = {"prompt": PROMPT, "max_tokens": 2}
        assert client.post("/v1/completions", json=body).json()["model"] == "alias"
        named = client.post("/v1/completions", json={**body, "model": "alias"})
        assert named.status_code == 200
        assert client.post("/v1/completions", json={**body, "model": MODEL}).status_code == 404


# -- tokenize, detokenize, version ---------------------------------------------------------------


@pytest.mark.spec("SRV-051")
def test_tokenize_matches_what_a_request_is_charged(server: Running, tokenizer: Tokenizer) -> None:
    response = post_json(f"{server.url}/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer.encode(PROMPT)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == CONFIG.max_model_len
    assert body["token_strs"] is None
    completion = post_json(f"{server.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == body["count"]

    strs = post_json(f"{server.url}/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert strs.json()["token_strs"] == [tokenizer.decode([t]) for t in body["tokens"]]

    chat = post_json(f"{server.url}/tokenize", {"messages": CHAT})
    assert chat.status_code == 200, chat.text
    assert chat.json()["tokens"] == tokenizer.apply_chat_template(CHAT)
    chat_completion = post_json(
        f"{server.url}/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}
    )
    assert chat_completion.json()["usage"]["prompt_tokens"] == chat.json()["count"]


@pytest.mark.spec("SRV-051")
def test_detokenize_and_errors(server: Running, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    response = post_json(f"{server.url}/detokenize", {"model": MODEL, "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": tokenizer.decode(ids)}
    assert error_of(post_json(f"{server.url}/detokenize", {"tokens": [-1]}), 400)
    assert error_of(post_json(f"{server.url}/detokenize", {"tokens": [2**40]}), 400)
    # a negative prompt id, echoed, once reached the tokenizer's decode and was a 500
    completions = f"{server.url}/v1/completions"
    for prompt in ([-1], [[5, -1]], [2**40]):
        body = {"prompt": prompt, "echo": True, "max_tokens": 1}
        assert error_of(post_json(completions, body), 400)
    wrong = post_json(f"{server.url}/tokenize", {"model": "other", "prompt": "x"})
    assert error_of(wrong, 404)["param"] == "model"
    assert error_of(post_json(f"{server.url}/tokenize", {"prompt": 5}), 400)


@pytest.mark.spec("SRV-052")
def test_version(server: Running) -> None:
    response = httpx.get(f"{server.url}/version")
    assert response.status_code == 200
    assert response.json() == {"version": __version__}


# -- unknown fields, seeds, Unicode ---------------------------------------------------------------


@pytest.mark.spec("SRV-053")
def test_unknown_fields_are_logged_as_ignored(
    server: Running, caplog: pytest.LogCaptureFixture
) -> None:
    body: dict[str, Any] = {
        "prompt": PROMPT,
        "max_tokens": 2,
        "user": "someone",  # declared and noted (SRV-118): not reported
        "frequency_penalty": 0.5,  # declared and honored: not reported
        "vendor_hint": True,
        "stream_options_typo": True,
    }
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        response = post_json(f"{server.url}/v1/completions", body)
        chat = post_json(
            f"{server.url}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "name": "ann"}], "max_tokens": 2},
        )
    assert response.status_code == 200, response.text
    assert chat.status_code == 200, chat.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "ignored" in w
        and "'vendor_hint'" in w
        and "'stream_options_typo'" in w
        and "'user'" not in w
        and "'frequency_penalty'" not in w
        and "'max_tokens'" not in w
        for w in warnings
    ), warnings
    assert any("'messages.0.name'" in w for w in warnings), warnings
    caplog.clear()
    many = {f"extra_{i:02d}": i for i in range(30)}
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        assert post_json(f"{server.url}/tokenize", {"prompt": "x", **many}).status_code == 200
    (line,) = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert "'extra_19'" in line
    assert "'extra_20'" not in line
    assert line.endswith(" and 10 more")


@pytest.mark.spec("SRV-054")
@pytest.mark.parametrize("seed", [2**64, -1, 10**30])
def test_a_seed_the_generator_cannot_take_is_400(server: Running, seed: int) -> None:
    for path, extra in (
        ("completions", {"prompt": PROMPT}),
        ("chat/completions", {"messages": CHAT}),
    ):
        body = {**extra, "max_tokens": 2, "temperature": 1.0, "seed": seed}
        error = error_of(post_json(f"{server.url}/v1/{path}", body), 400)
        assert error["param"] == "seed"


@pytest.mark.spec("SRV-054")
def test_the_largest_seed_is_served(server: Running) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 1.0, "seed": 2**64 - 1}
    first = post_json(f"{server.url}/v1/completions", body)
    assert first.status_code == 200, first.text
    again = post_json(f"{server.url}/v1/completions", body)
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]


@pytest.mark.spec("SRV-055")
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"prompt": "a\ud800b"}, "prompt"),
        ("completions", {"prompt": ["fine", "x\udfffy"]}, "prompt.1"),
        ("completions", {"prompt": PROMPT, "stop": "\ud83d"}, "stop"),
        ("completions", {"prompt": PROMPT, "stop": ["ok", "\udc00"]}, "stop.1"),
        ("completions", {"prompt": PROMPT, "cache_salt": "s\ud800"}, "cache_salt"),
        ("chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, None),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages.0.content.0.text",
        ),
    ],
)
def test_text_that_is_not_valid_unicode_is_400(
    server: Running, path: str, body: dict[str, Any], param: str | None
) -> None:
    error = error_of(post_json(f"{server.url}/v1/{path}", {**body, "max_tokens": 2}), 400)
    assert error["code"] == "invalid_unicode"
    assert error["param"] == (param or "messages.0.content")
    assert "Unicode" in error["message"] or "unicode" in error["message"]
    tokenize = post_json(f"{server.url}/tokenize", {"prompt": "a\ud800"})
    assert error_of(tokenize, 400)["param"] == "prompt"


# -- metrics and logging ------------------------------------------------------------------------


@pytest.mark.spec("SRV-081")
def test_startup_summary_and_throughput_lines_are_logged(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(
        load_engine(model_dir, CONFIG),
        MODEL,
        config=ServerConfig(log_stats_interval_s=0.05),
    )
    with (
        caplog.at_level(logging.INFO, logger="pagedkv.server"),
        TestClient(app) as client,
    ):
        body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
            "generation throughput" in r.getMessage() for r in caplog.records
        ):
            time.sleep(0.05)
    messages = [r.getMessage() for r in caplog.records if r.name == "pagedkv.server"]
    assert any(m.startswith(f"serving '{MODEL}': max_model_len 256") for m in messages), messages
    assert any("64 prompts per request" in m and "auth: none" in m for m in messages)
    throughput = [m for m in messages if "generation throughput" in m]
    assert throughput, messages
    assert "tokens/s" in throughput[0]
    assert "KV pages in use" in throughput[0]
    assert any(
        m.startswith("engine stopped: 0 requests aborted, 0 KV pages in use") for m in messages
    )


@pytest.mark.spec("SRV-081")
def test_log_level_flag_sets_the_pagedkv_logger() -> None:
    args = build_parser().parse_args(["serve", "--log-level", "debug"])
    assert args.log_level == "debug"
    assert build_parser().parse_args(["serve"]).log_level == "info"


@pytest.mark.spec("SRV-082")
def test_python_dash_m_pagedkv_runs_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: pagedkv serve")
    for flag in ("--api-key", "--max-waiting-requests", "--request-timeout", "--header-timeout"):
        assert flag in result.stdout
