"""Tenant isolation (SRV-070..SRV-074): ``cache_salt`` on both endpoints, API keys, and one
prefix-cache namespace per key, so that nothing a client can read without a clock tells it
whether another tenant sent a prompt.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AuthenticationError, OpenAI
from server_harness import Running, error_of, metric, post_json, running, wait_idle
from serving_models import tiny_chat_model

from pagedkv.backend import load_engine
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.server.app import ServerConfig, create_app
from pagedkv.errors import InvalidRequest

MODEL = "tiny"
CONFIG = EngineConfig(page_size=8, num_pages=96, max_model_len=256)
KEY_A = "key-of-tenant-a"
KEY_B = "key-of-tenant-b"
METRICS_KEY = "key-of-the-operator"
#: Several full pages long, so that a repeat of it is served from the prefix cache.
LONG = "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n" * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def open_server(model_dir: Path) -> Iterator[Running]:
    """No keys: salts come from the requests only."""
    app = create_app(load_engine(model_dir, CONFIG), MODEL)
    with running(app) as server:
        yield server


@pytest.fixture(scope="module")
def tenant_server(model_dir: Path) -> Iterator[Running]:
    """Two keys, each its own prefix-cache namespace."""
    config = ServerConfig(
        api_keys=(KEY_A, KEY_B), cache_salt_per_api_key=True, metrics_api_key=METRICS_KEY
    )
    app = create_app(load_engine(model_dir, CONFIG), MODEL, config=config)
    with running(app) as server:
        yield server


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    tokens: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens


def completion(
    url: str, key: str | None = None, prompt: str = LONG, **extra: Any
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": prompt, "max_tokens": 2, **extra}
    return post_json(f"{url}/v1/completions", body, **headers)


def chat(url: str, key: str | None = None, prompt: str = LONG, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2, **extra}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return post_json(f"{url}/v1/chat/completions", body, **headers)


@pytest.mark.spec("SRV-070")
def test_cache_salt_separates_prefix_caches(open_server: Running) -> None:
    url = open_server.url
    for send in (completion, chat):
        assert cached(send(url, cache_salt="salt-one")) == 0
        assert cached(send(url, cache_salt="salt-two")) == 0  # same prompt, other salt
        assert cached(send(url, cache_salt="salt-one")) > 0
        assert cached(send(url)) == 0  # no salt is a namespace of its own
        assert cached(send(url)) > 0
    wait_idle(open_server.bridge)


@pytest.mark.spec("SRV-070")
def test_an_empty_cache_salt_is_400(open_server: Running) -> None:
    assert error_of(completion(open_server.url, cache_salt=""), 400)["param"] == "cache_salt"
    assert error_of(chat(open_server.url, cache_salt=""), 400)["param"] == "cache_salt"


@pytest.mark.spec("SRV-071")
def test_api_keys_are_required_except_for_health(tenant_server: Running) -> None:
    url = tenant_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY_A}"}):
        for method, path in (
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/tokenize"),
            ("GET", "/version"),
            ("GET", "/openapi.json"),
        ):
            response = httpx.request(method, f"{url}{path}", headers=headers, json={})
            error = error_of(response, 401)
            assert error["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
    for near in (KEY_A[:-1], KEY_A + "x", KEY_A.upper(), f" {KEY_B}x"):
        error_of(completion(url, near), 401)
    assert httpx.get(f"{url}/health").status_code == 200
    assert completion(url, KEY_A).status_code == 200
    scheme = httpx.get(f"{url}/v1/models", headers={"Authorization": f"bearer {KEY_B}"})
    assert scheme.status_code == 200
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY_B, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    wait_idle(tenant_server.bridge)


def prefix_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).text
    return metric(text, "vllm:prefix_cache_hits_total", model_name=MODEL)


@pytest.mark.spec("SRV-072")
def test_tenants_never_hit_each_others_pages(tenant_server: Running) -> None:
    url = tenant_server.url
    secret = "# tenant secret\n" + LONG  # starts as no other test prompt does
    for send in (completion, chat):
        assert cached(send(url, KEY_A, secret)) == 0
        assert cached(send(url, KEY_A, secret)) > 0  # a tenant reuses its own pages
        hits = prefix_hits(url)
        probe = send(url, KEY_B, secret)  # the other tenant sends the very same prompt
        assert cached(probe) == 0
        assert prefix_hits(url) == hits  # no hit anywhere, not even in the aggregate
        # the request's own salt cannot reach into another tenant's namespace either
        assert cached(send(url, KEY_B, secret, cache_salt="shared")) == 0
        assert cached(send(url, KEY_A, secret, cache_salt="shared")) == 0
        assert cached(send(url, KEY_A, secret, cache_salt="shared")) > 0
    wait_idle(tenant_server.bridge)


@pytest.mark.spec("SRV-072")
def test_streamed_usage_does_not_leak_across_tenants(tenant_server: Running) -> None:
    url = tenant_server.url
    prompt = "# streamed\n" + LONG
    seen = []
    for key in (KEY_A, KEY_A, KEY_B):
        body = {
            "prompt": prompt,
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: {")]
        usage = json.loads(events[-1][len("data: ") :])["usage"]
        seen.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert seen[0] == 0
    assert seen[1] > 0
    assert seen[2] == 0
    wait_idle(tenant_server.bridge)


# -- safe defaults: several keys isolate, /metrics takes the metrics key alone ------------------


def _serve(model_dir: Path, config: ServerConfig) -> Any:
    return running(create_app(load_engine(model_dir, CONFIG), MODEL, config=config))


@pytest.mark.spec("SRV-073")
def test_several_keys_isolate_tenants_by_default(model_dir: Path) -> None:
    """Catches the old default, where several keys shared one prefix cache unless the
    operator remembered ``--cache-salt-per-api-key``: tenant B learned tenant A's prompt page by
    page through ``cached_tokens``. Only ``shared_prefix_cache`` shares, on purpose."""
    secret = "# default isolation\n" + LONG
    with _serve(model_dir, ServerConfig(api_keys=(KEY_A, KEY_B))) as server:
        assert cached(completion(server.url, KEY_A, secret)) == 0
        assert cached(completion(server.url, KEY_A, secret)) > 0
        assert cached(completion(server.url, KEY_B, secret)) == 0
        assert cached(chat(server.url, KEY_A, secret)) == 0
        assert cached(chat(server.url, KEY_B, secret)) == 0
        wait_idle(server.bridge)
    shared = ServerConfig(api_keys=(KEY_A, KEY_B), shared_prefix_cache=True)
    with _serve(model_dir, shared) as server:
        assert cached(completion(server.url, KEY_A, secret)) == 0
        assert cached(completion(server.url, KEY_B, secret)) > 0
        wait_idle(server.bridge)


@pytest.mark.spec("SRV-073")
def test_contradicting_tenant_flags_are_refused() -> None:
    """Catches flags accepted and dropped: sharing and per-key salting together, or sharing
    with no keys to share between, are refused naming the flags."""
    with pytest.raises(InvalidRequest, match="--shared-prefix-cache"):
        ServerConfig(api_keys=(KEY_A, KEY_B), shared_prefix_cache=True, cache_salt_per_api_key=True)
    with pytest.raises(InvalidRequest, match="--shared-prefix-cache"):
        ServerConfig(shared_prefix_cache=True)
    assert ServerConfig(api_keys=(KEY_A,), cache_salt_per_api_key=True).tenant_per_key
    assert not ServerConfig(api_keys=(KEY_A,)).tenant_per_key
    assert ServerConfig(api_keys=(KEY_A, KEY_B)).tenant_per_key


@pytest.mark.spec("SRV-074")
def test_metrics_take_only_the_metrics_key(model_dir: Path) -> None:
    """Catches ``/metrics`` readable with any tenant's key (it shows every tenant's prompt
    lengths, timings and repeats): a tenant's key is answered 403, no key 401, the metrics key
    200; and the metrics key opens no other endpoint. Without a metrics key, keys close
    ``/metrics`` to every tenant."""
    config = ServerConfig(api_keys=(KEY_A, KEY_B), metrics_api_key=METRICS_KEY)
    with _serve(model_dir, config) as server:
        url = f"{server.url}/metrics"
        for key in (KEY_A, KEY_B):
            error = error_of(httpx.get(url, headers={"Authorization": f"Bearer {key}"}), 403)
            assert error["code"] == "forbidden"
        error_of(httpx.get(url), 401)
        error_of(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401)
        ok = httpx.get(url, headers={"Authorization": f"Bearer {METRICS_KEY}"})
        assert ok.status_code == 200
        assert "vllm:prompt_tokens" in ok.text
        error_of(completion(server.url, METRICS_KEY), 401)
    with _serve(model_dir, ServerConfig(api_keys=(KEY_A,))) as server:
        headers = {"Authorization": f"Bearer {KEY_A}"}
        error_of(httpx.get(f"{server.url}/metrics", headers=headers), 403)
    with _serve(model_dir, ServerConfig(metrics_api_key=METRICS_KEY)) as server:
        error_of(httpx.get(f"{server.url}/metrics"), 401)
        assert completion(server.url).status_code == 200
        wait_idle(server.bridge)
    with pytest.raises(InvalidRequest, match="--metrics-api-key"):
        ServerConfig(api_keys=(KEY_A,), metrics_api_key=KEY_A)


@pytest.mark.spec("SRV-074")
def test_serve_help_documents_the_metrics_key() -> None:
    """Catches an undocumented flag: ``pagedkv serve --help`` names ``--metrics-api-key``,
    its environment variable and ``--shared-prefix-cache``."""
    from pagedkv.entrypoints.cli.main import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = subparsers.choices["serve"].format_help()
    for needle in ("--metrics-api-key", "PAGEDKV_METRICS_API_KEY", "--shared-prefix-cache"):
        assert needle in text


@pytest.mark.spec("SRV-073", "SRV-074")
def test_serve_flags_reach_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a flag parsed and dropped: ``--shared-prefix-cache`` and ``--metrics-api-key``
    (or ``$PAGEDKV_METRICS_API_KEY``) reach the app's config, and several keys without either
    flag salt per key."""
    from pagedkv.entrypoints.cli.main import build_parser
    from pagedkv.entrypoints.cli.serve import build_server_config

    monkeypatch.delenv("PAGEDKV_API_KEY", raising=False)
    monkeypatch.delenv("PAGEDKV_METRICS_API_KEY", raising=False)
    parser = build_parser()
    keys = ["serve", "--api-key", KEY_A, "--api-key", KEY_B]
    default = build_server_config(parser.parse_args(keys))
    assert default.tenant_per_key
    assert default.metrics_api_key is None
    given = parser.parse_args([*keys, "--shared-prefix-cache", "--metrics-api-key", METRICS_KEY])
    config = build_server_config(given)
    assert config.shared_prefix_cache
    assert not config.tenant_per_key
    assert config.metrics_api_key == METRICS_KEY
    monkeypatch.setenv("PAGEDKV_METRICS_API_KEY", "from-the-environment")
    assert build_server_config(parser.parse_args(keys)).metrics_api_key == "from-the-environment"
    with pytest.raises(InvalidRequest, match="--cache-salt-per-api-key"):
        build_server_config(
            parser.parse_args([*keys, "--shared-prefix-cache", "--cache-salt-per-api-key"])
        )
