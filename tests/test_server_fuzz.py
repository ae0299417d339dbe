"""Property-based fuzzing of every endpoint from the app's own OpenAPI schema (SRV-056).

schemathesis turns the schema FastAPI publishes into Hypothesis strategies: bodies that fit it
(positive) and bodies that break it (negative: wrong types, missing fields, out-of-range
numbers, unexpected properties). Each generated request goes to the real server; none may be
answered 5xx, and afterwards no KV page may be in use. The server runs the real tokenizer and
chat template of a tiny chat model over the hash stand-in model, so a generation costs about a
millisecond a token and the fuzzing is spent on the server. The number of examples per mode is
bounded so that the whole run stays within seconds; raise ``PAGEDKV_FUZZ_EXAMPLES`` for a
longer hunt.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from server_harness import Running, running, wait_idle
from serving_models import tiny_chat_model

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.entrypoints.server.app import ServerConfig, create_app
from pagedkv.testing.hash_runner import HashRunner

#: Examples per generation mode (positive and negative), all endpoints together.
EXAMPLES = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "150"))
#: A short context keeps every generated request to a few milliseconds.
CONFIG = EngineConfig(page_size=4, num_pages=64, max_model_len=64)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    model_dir: Path = tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    tokenizer = Tokenizer(model_dir)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    runner = HashRunner(vocab, num_pages=CONFIG.num_pages, page_size=CONFIG.page_size)
    engine = reference_backend().create_engine(runner, CONFIG, tokenizer=tokenizer)
    app = create_app(engine, "fuzz", config=ServerConfig(log_stats_interval_s=None))
    with running(app) as served:
        yield served


@pytest.mark.spec("SRV-056")
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_is_a_server_error(server: Running, mode: GenerationMode) -> None:
    app = server.server.config.app
    schema = schemathesis.openapi.from_dict(app.openapi())
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= paths
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations])
    answered: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=cases)
    def no_server_error(case: Case) -> None:
        response = case.call(base_url=server.url, timeout=60)
        answered[response.status_code] = answered.get(response.status_code, 0) + 1
        assert response.status_code < 500, (
            f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}"
        )

    logging.getLogger("pagedkv.server").setLevel(logging.ERROR)  # ignored-field warnings
    try:
        no_server_error()
    finally:
        logging.getLogger("pagedkv.server").setLevel(logging.NOTSET)
    assert sum(answered.values()) >= EXAMPLES // 2, answered
    if mode is GenerationMode.POSITIVE:
        assert answered.get(200, 0) > 0, answered  # some generations really ran
    else:
        assert any(400 <= status < 500 for status in answered), answered
    stats = wait_idle(server.bridge)
    assert stats.pages_in_use == 0
