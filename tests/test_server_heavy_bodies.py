"""Heavy request bodies cost only their sender (SRV-115..SRV-117).

Text is tokenized, rendered and decoded apart from the engine thread; a text whose size alone
proves it too long is refused before it is tokenized; and a running stream keeps its pace
while big bodies arrive.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from server_harness import Running, error_of, post_json, running, wait_idle
from serving_models import tiny_chat_model

from pagedkv.assets import has_default_model
from pagedkv.backend import load_engine
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.detokenizer import DecodeStep
from pagedkv.engine.tokenizer import Message, Tokenizer
from pagedkv.entrypoints.server.app import ServerConfig, create_app
from pagedkv.testing.faults import FaultyTokenizer

MODEL = "tiny"
CONFIG = EngineConfig(page_size=8, num_pages=64, max_model_len=256)
QUIET = ServerConfig(log_stats_interval_s=None)
PROMPT = "def fibonacci(n):\n"
CHAT = [{"role": "user", "content": "Hello!"}]
#: The name of the text worker's thread starts so (the engine's is ``pagedkv-engine``).
TEXT_THREAD = "pagedkv-text"


class ThreadRecorder(FaultyTokenizer):
    """The model's tokenizer, recording which thread encodes, renders and decodes (and the
    size of each text encoded); the incremental decoder of generated text is the inner one's,
    unrecorded: it runs in the engine's step by design (SRV-115)."""

    def __init__(self, inner: Tokenizer) -> None:
        super().__init__(inner, lambda ids: False)
        self.calls: list[tuple[str, str]] = []  # (method, thread name)
        self.encoded: list[int] = []  # characters of each text encoded
        self._lock = threading.Lock()

    def _record(self, method: str) -> None:
        with self._lock:
            self.calls.append((method, threading.current_thread().name))

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        self._record("encode")
        with self._lock:
            self.encoded.append(len(text))
        return super().encode(text, *args, **kwargs)

    def decode(self, token_ids: Sequence[int], *args: Any, **kwargs: Any) -> str:
        self._record("decode")
        return super().decode(token_ids, *args, **kwargs)

    def render_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> str:
        self._record("render")
        return super().render_chat_template(messages, template_kwargs, tools, **options)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> list[int]:
        self._record("apply_chat_template")
        return super().apply_chat_template(messages, template_kwargs, tools, **options)

    def incremental_decoder(
        self, *, window: bool = False, skip_special_tokens: bool = True
    ) -> DecodeStep:
        return self._inner.incremental_decoder(
            window=window, skip_special_tokens=skip_special_tokens
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def recorded(model_dir: Path) -> Iterator[tuple[Running, ThreadRecorder]]:
    engine = load_engine(model_dir, CONFIG)
    assert engine.tokenizer is not None
    recorder = ThreadRecorder(engine.tokenizer)
    engine.tokenizer = recorder
    with running(create_app(engine, MODEL, config=QUIET)) as server:
        yield server, recorder


@pytest.mark.spec("SRV-115")
def test_the_engine_thread_never_tokenizes_renders_or_decodes_text(
    recorded: tuple[Running, ThreadRecorder],
) -> None:
    """Every way a request turns text into ids or ids into text runs on the text worker:
    caught if any runs on the engine thread (tokenizing in ``_add``, decoding logprobs' token
    texts in ``_route``, ``/tokenize`` through ``run_on_engine``), as it did when one big body
    stalled every stream, or on the event loop, which would stall every stream's delivery."""
    server, recorder = recorded
    url = server.url
    recorder.calls.clear()
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 2, "echo": True}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 1}),
        (
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 4, "logprobs": 1, "stream": True, "stop": ["zz"]},
        ),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "logprobs": True}),
        ("/tokenize", {"prompt": PROMPT, "return_token_strs": True}),
        ("/tokenize", {"messages": CHAT}),
        ("/detokenize", {"tokens": [5, 6, 7]}),
        ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "echo": True}),
    ]
    for path, body in bodies:
        response = post_json(url + path, body)
        assert response.status_code == 200, (path, response.text)
    wait_idle(server.bridge)
    methods = {method for method, _ in recorder.calls}
    assert {"encode", "decode", "render"} <= methods, methods
    elsewhere = [call for call in recorder.calls if not call[1].startswith(TEXT_THREAD)]
    assert not elsewhere, elsewhere


@pytest.mark.spec("SRV-116", "SRV-015")
@pytest.mark.parametrize(
    ("path", "field"),
    [("/v1/completions", "prompt"), ("/tokenize", "prompt"), ("/v1/chat/completions", "messages")],
)
def test_a_text_too_long_to_fit_is_refused_before_it_is_tokenized(
    recorded: tuple[Running, ThreadRecorder], path: str, field: str
) -> None:
    """One byte past ``max_model_len x bytes_per_token`` (two-byte characters, so counting
    characters instead of bytes is caught): 400 naming the field, and the tokenizer never
    encoded it; at the bound the text is tokenized as before. Caught if the text is tokenized
    first (then refused as too many tokens), or not refused at all (``/tokenize``)."""
    server, recorder = recorded
    bound = server.bridge.text.max_text_bytes
    assert bound is not None
    per_token = recorder.bytes_per_token()
    assert per_token is not None
    assert bound == CONFIG.max_model_len * per_token
    text = "é" * (bound // 2 + 1)
    assert len(text) < bound < len(text.encode("utf-8"))
    body: dict[str, Any] = {} if path == "/tokenize" else {"max_tokens": 1}
    if field == "messages":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    recorder.encoded.clear()
    error = error_of(post_json(server.url + path, body), 400)
    assert error["param"] == field
    assert error["code"] == "context_length_exceeded"
    assert str(bound) in error["message"]
    assert not [n for n in recorder.encoded if n >= len(text)], "the text was tokenized"
    if path == "/tokenize":
        at_bound = post_json(server.url + path, {"prompt": "é" * (bound // 2)})
        assert at_bound.status_code == 200, at_bound.text
        assert at_bound.json()["count"] * per_token >= bound  # the bound holds for this text


@pytest.mark.spec("SRV-117")
@pytest.mark.skipif(not has_default_model(), reason="the embedded model is not built")
def test_a_stream_keeps_its_pace_while_big_bodies_arrive() -> None:
    """The embedded model's real tokenizer; three ``/tokenize`` bodies of 1,000,000 characters
    and a completion of 1,000,001 sent while a 200-token stream runs. With tokenization on the
    engine thread the stream's largest gap was 3-12 s; here it must stay under twice its gap
    alone, or under ``stall.STALL_FLOOR_S`` (a loaded shared machine stretches a 15 ms gap by
    more than 2x on its own; the floor is still under half the stall this catches)."""
    from stall import run_stall

    (report,) = run_stall(rounds=1, unbounded=False)
    assert report.statuses == (400, 400, 400, 400)  # refused by size (SRV-116)
    assert report.ok, report.line()
